"""The slow, model-level path to replayed states, for calibration, quality measurements and
tests: prefill with exact KV, swap in states rebuilt from anchors, continue, compare.

Everything here uses the model's public primitives only (capture_hidden, replay_group,
PagedSession), never the engine, so it is an independent check of the engine's fast path.
"""

from __future__ import annotations

import torch

from backend.model import HybridForCausalLM
from backend.model.batch import ForwardBatch, SeqInput
from backend.model.generate import PagedSession
from backend.model.quant import dequantize_int8, quantize_int8
from backend.replay.anchors import AnchorLayout

LinearStates = list[tuple[torch.Tensor, torch.Tensor]]  # per linear layer: (conv, rec)


def anchor_positions(layout: AnchorLayout, boundary: int) -> torch.Tensor:
    """Positions of all anchors before page boundary `boundary`, ascending."""
    pages = torch.arange(boundary // layout.page_size)
    return (pages.unsqueeze(1) * layout.page_size + layout.offsets).reshape(-1)


@torch.inference_mode()
def replayed_states(model: HybridForCausalLM, hidden: torch.Tensor, k: int,
                    int8: bool = False) -> LinearStates:
    """States from replaying the last k of the given anchors. hidden: [G, N, D] (position
    order) -> (conv, rec) per linear layer, each without a batch dim."""
    cfg = model.config
    out: LinearStates = [None] * len(cfg.linear_layer_ids)  # type: ignore[list-item]
    for g, layers in enumerate(cfg.group_state_layers):
        rows = hidden[g, -k:]
        if int8:
            rows = dequantize_int8(*quantize_int8(rows), dtype=rows.dtype)
        for layer_id, (conv, rec) in zip(layers, model.replay_group(g, rows.unsqueeze(0))):
            out[cfg.linear_layer_ids.index(layer_id)] = (conv[0], rec[0])
    return out


@torch.inference_mode()
def exact_run(model: HybridForCausalLM, ids: list[int], boundary: int, page_size: int = 64):
    """Prefill ids[:boundary]; returns (session, exact states at boundary)."""
    session = PagedSession(model, batch_size=1, max_tokens=len(ids), page_size=page_size)
    session.step([ids[:boundary]])
    return session, session.states.read(0)


@torch.inference_mode()
def continuation_logits(session: PagedSession, states: LinearStates, suffix: list[int]
                        ) -> torch.Tensor:
    """Logits [len(suffix), V] of `suffix` fed after the session's prefix with `states`.

    The session's KV is kept; its state slot is overwritten, and restored afterwards so the
    same prefix can be continued with other states.
    """
    saved = session.states.read(0)
    length = session.lengths[0]
    session.states.write(0, states)
    seq = SeqInput(suffix, length, session.page_tables[0], 0)
    batch = ForwardBatch.build([seq], session.kv, session.states, device=session.model.device)
    logits = session.model.forward_batch(batch, last_only=False)[0, : len(suffix)].float()
    session.states.write(0, saved)
    return logits


def relative_state_error(approx: LinearStates, exact: LinearStates, layer_ids: list[int]
                         ) -> float:
    """||S' - S|| / ||S|| over the recurrent states of the given linear-layer indices."""
    num = sum(float((approx[i][1] - exact[i][1]).pow(2).sum()) for i in layer_ids)
    den = sum(float(exact[i][1].pow(2).sum()) for i in layer_ids)
    return (num / max(den, 1e-30)) ** 0.5
