"""CPU implementations of the operators (vectorised PyTorch; also correct on any device).

The packed sequences are gathered into one right-padded batch, run through the model's own
chunked gated delta rule, Mamba2 scan or causal conv (padding positions carry g = 0 and beta = 0
or v = 0, so they leave states untouched), then scattered back to the packed layout.
"""

from __future__ import annotations

import torch

from backend.model.conv import causal_conv1d
from backend.model.delta_rule import chunk_gated_delta_rule, gated_delta_step
from backend.model.mamba_scan import chunk_ssd, recurrent_ssd
from backend.model.mlp import combine_experts
from plugins.reference import expert_ffn


def _padding_plan(cu_seqlens: torch.Tensor, total: int):
    """(gather index [N, L], valid mask [N, L], lengths [N]) for packed -> padded."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    L = max(int(lengths.max()) if lengths.numel() else 0, 1)
    pos = torch.arange(L, device=cu.device)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
    index = (cu[:-1].unsqueeze(1) + pos).clamp(max=max(total - 1, 0))
    return index, valid, lengths


def _pad(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_zeros(*index.shape, *x.shape[1:])
    out = x[index]
    return out * valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(out.dtype)


def _one_token_each(x: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Every sequence has exactly one token (a decode step): no padding needed."""
    n = cu_seqlens.shape[0] - 1
    if x.shape[0] != n:
        return False
    return bool(torch.equal(cu_seqlens.long(), torch.arange(n + 1, device=cu_seqlens.device)))


def _scan_cpu(step, chunked, inputs, cu_seqlens, initial_state, **kw):
    """A scan over packed sequences: `step` (the recurrent form) when every sequence has one
    token, else `chunked` over the right-padded batch. inputs: (q, k, v, ...) [T, H, *]."""
    v = inputs[2]
    if _one_token_each(inputs[0], cu_seqlens):
        o, final = step(*(t[:, None] for t in inputs), initial_state=initial_state, **kw)
        return o[:, 0].to(v.dtype), final.float()
    index, valid, _ = _padding_plan(cu_seqlens, v.shape[0])
    padded = [_pad(t, index, valid) for t in inputs]
    rule = step if padded[0].shape[1] == 1 else chunked
    o, final = rule(*padded, initial_state=initial_state, **kw)
    return o[valid].to(v.dtype), final.float()


def _scan_snap_cpu(step, chunked, inputs, cu_seqlens, initial_state, snap_offsets, **kw):
    """`_scan_cpu` plus a third result, snap [N, *state]: the state after the first
    `snap_offsets[n]` tokens of sequence n (a positive multiple of the chunked rule's chunk,
    64, within the sequence), or its final state where the offset is 0."""
    index, valid, lengths = _padding_plan(cu_seqlens, inputs[0].shape[0])
    off = snap_offsets.long()
    rows = (off > 0).nonzero().view(-1)
    if bool(((off < 0) | (off > lengths)).any()):
        raise ValueError("snapshot offsets must lie within their sequences")
    if rows.numel() == 0:
        o, final = _scan_cpu(step, chunked, inputs, cu_seqlens, initial_state, **kw)
        return o, final, final.clone()
    padded = [_pad(t, index, valid) for t in inputs]
    o, final, snaps = chunked(*padded, initial_state=initial_state, states_at=(rows, off[rows]),
                              **kw)
    snap = final.float().clone()
    snap[rows] = snaps.float()
    return o[valid].to(inputs[2].dtype), final.float(), snap


def gated_delta_scan_cpu(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    return _scan_cpu(gated_delta_step, chunk_gated_delta_rule, (q, k, v, g, beta), cu_seqlens,
                     initial_state, scale=scale)


def gated_delta_scan_snap_cpu(q, k, v, g, beta, cu_seqlens, initial_state, snap_offsets,
                              scale):
    return _scan_snap_cpu(gated_delta_step, chunk_gated_delta_rule, (q, k, v, g, beta),
                          cu_seqlens, initial_state, snap_offsets, scale=scale)


def ssd_scan_cpu(q, k, v, g, cu_seqlens, initial_state):
    """The Mamba2 scan (padding positions carry g = 0 and v = 0: the state passes them)."""
    return _scan_cpu(recurrent_ssd, chunk_ssd, (q, k, v, g), cu_seqlens, initial_state)


def ssd_scan_snap_cpu(q, k, v, g, cu_seqlens, initial_state, snap_offsets):
    return _scan_snap_cpu(recurrent_ssd, chunk_ssd, (q, k, v, g), cu_seqlens, initial_state,
                          snap_offsets)


def causal_conv1d_cpu(x, weight, cu_seqlens, initial_state, silu):
    if _one_token_each(x, cu_seqlens):
        y, final = causal_conv1d(x[:, None], weight, initial_state, None, silu)
        return y[:, 0], final.to(x.dtype)
    index, valid, lengths = _padding_plan(cu_seqlens, x.shape[0])
    y, final = causal_conv1d(_pad(x, index, valid), weight, initial_state, lengths, silu)
    return y[valid], final.to(x.dtype)


def anchor_capture_cpu(hidden, src, dst, pool) -> None:
    pool.index_copy_(0, dst.long(), hidden.index_select(0, src.long()).to(pool.dtype))


def moe_experts_cpu(h, weights, index, w_in, w_down, activation):
    """Each expert once over the tokens routed to it (the model's `combine_experts`), fp32
    sums."""
    return combine_experts(lambda e, rows: expert_ffn(rows, w_in[e], w_down[e], activation),
                           w_in.shape[0], w_down.shape[1], h, weights, index.long(),
                           torch.float32)
