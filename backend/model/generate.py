"""Standalone paged generation for tools, tests and benchmarks that run without the engine.

Pages are handed out from a private free list; the engine replaces this with the prefix store.
"""

from __future__ import annotations

import torch

from backend.model.batch import ForwardBatch, SeqInput
from backend.model.hybrid import HybridForCausalLM
from backend.model.kv_cache import PagedKV, StateSlots


class PagedSession:
    """B sequences with their own page tables and state slots over private buffers."""

    def __init__(
        self, model: HybridForCausalLM, batch_size: int, max_tokens: int, page_size: int = 64
    ) -> None:
        self.model = model
        pages_per_seq = -(-max_tokens // page_size)
        cfg, dtype, dev = model.config, model.dtype, model.device
        self.kv = PagedKV.allocate(cfg, batch_size * pages_per_seq, page_size, dtype, dev)
        self.states = StateSlots.allocate(cfg, batch_size, dtype, dev)
        # Interleave pages across sequences so no test can pass by assuming contiguity.
        self.page_tables = [
            torch.arange(b, batch_size * pages_per_seq, batch_size) for b in range(batch_size)
        ]
        self.lengths = [0] * batch_size
        self.max_tokens = max_tokens
        self.adapters = [0] * batch_size  # each sequence's LoRA adapter (0: none)

    def step(self, chunks: list[list[int]], rows: list[int] | None = None) -> torch.Tensor:
        """Feeds `chunks[i]` to sequence `rows[i]`; returns last-token logits [len(chunks), V]."""
        rows = list(range(len(chunks))) if rows is None else rows
        seqs = []
        for r, chunk in zip(rows, chunks):
            if self.lengths[r] + len(chunk) > self.max_tokens:
                raise ValueError(
                    f"sequence {r} would hold {self.lengths[r] + len(chunk)} tokens, "
                    f"more than max_tokens={self.max_tokens}"
                )
            seqs.append(SeqInput(chunk, self.lengths[r], self.page_tables[r], r,
                                 self.adapters[r]))
        batch = ForwardBatch.build(seqs, self.kv, self.states, device=self.model.device)
        logits = self.model.forward_batch(batch)
        for r, chunk in zip(rows, chunks):
            self.lengths[r] += len(chunk)
        return logits


@torch.inference_mode()
def greedy_generate(
    model: HybridForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    page_size: int = 64,
    eos_token_id: int | None = None,
) -> list[list[int]]:
    """Batched greedy decoding: one batched prefill, then batched single-token steps."""
    max_len = max(len(p) for p in prompts) + max_new_tokens
    session = PagedSession(model, len(prompts), max_len, page_size)
    next_ids = session.step(prompts).argmax(-1)
    outputs = [[int(t)] for t in next_ids]
    done = [eos_token_id is not None and o[-1] == eos_token_id for o in outputs]
    for _ in range(max_new_tokens - 1):
        rows = [i for i, d in enumerate(done) if not d]
        if not rows:
            break
        next_ids = session.step([[outputs[r][-1]] for r in rows], rows).argmax(-1)
        for r, t in zip(rows, next_ids.tolist()):
            outputs[r].append(t)
            done[r] = eos_token_id is not None and t == eos_token_id
    return outputs
