"""Plain PyTorch references for the custom operators: the definitions every implementation
(CPU op, Triton kernel, TensorRT plugin) is tested against. Slow on purpose: one Python loop
per sequence and per token, no fusion.

Packed variable-length layout (as flash-linear-attention's varlen API): the tokens of N
sequences lie back to back along the first dimension; `cu_seqlens` [N + 1] (int) holds the
offsets, sequence n being rows cu_seqlens[n]:cu_seqlens[n + 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.model.delta_rule import recurrent_gated_delta_rule
from backend.model.mamba_scan import recurrent_ssd


def anchor_capture_ref(hidden: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                       pool: torch.Tensor) -> None:
    """pool[dst[i]] = hidden[src[i]] for every i (hidden [T, D], pool [R, D])."""
    for s, d in zip(src.tolist(), dst.tolist()):
        pool[d] = hidden[s].to(pool.dtype)


def _per_sequence(rule, inputs, cu_seqlens, initial_state):
    """Runs the recurrent `rule(*inputs[a:b] with a batch dim, h0)` on each packed sequence:
    (outputs shaped like v = inputs[2], final states fp32; an empty sequence keeps h0)."""
    q, k, v = inputs[:3]
    N = cu_seqlens.numel() - 1
    out = torch.zeros_like(v)
    finals = torch.zeros(N, q.shape[1], k.shape[2], v.shape[2], dtype=torch.float32,
                         device=q.device)
    bounds = cu_seqlens.tolist()
    for n in range(N):
        a, b = bounds[n], bounds[n + 1]
        h0 = None if initial_state is None else initial_state[n : n + 1]
        if b == a:
            finals[n] = 0 if h0 is None else h0[0].float()
            continue
        o, s = rule(*(t[None, a:b] for t in inputs), h0)
        out[a:b], finals[n] = o[0], s[0]
    return out, finals


def gated_delta_scan_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K]; v [T, H, V]; g, beta [T, H]; initial_state [N, H, K, V] or None.

    Returns the outputs [T, H, V] (dtype of v) and the final states [N, H, K, V] (fp32).
    """
    return _per_sequence(
        lambda q, k, v, g, beta, h0: recurrent_gated_delta_rule(q, k, v, g, beta, h0, scale),
        (q, k, v, g, beta), cu_seqlens, initial_state)


def ssd_scan_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 scan (`backend/model/mamba_scan.py`: S <- S exp(g_t) + k_t v_t^T,
    o_t = S^T q_t, no scale) over packed sequences. q, k [T, H, N]; v [T, H, P]; g [T, H];
    initial_state [S, H, N, P] or None. Returns outputs [T, H, P] (dtype of v) and the final
    states [S, H, N, P] (fp32)."""
    return _per_sequence(recurrent_ssd, (q, k, v, g), cu_seqlens, initial_state)


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None, silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv per sequence. x [T, C]; weight [C, W]; state [N, C, W - 1].

    Output row t of sequence n: sum_w weight[:, w] * x_ext[t - (W - 1) + w], where x_ext is the
    sequence preceded by its initial state (zeros when absent). Returns (y [T, C], the last
    W - 1 inputs of each sequence [N, C, W - 1]).
    """
    N, C, W = cu_seqlens.numel() - 1, x.shape[1], weight.shape[1]
    y = torch.zeros_like(x)
    finals = x.new_zeros(N, C, W - 1)
    bounds = cu_seqlens.tolist()
    for n in range(N):
        a, b = bounds[n], bounds[n + 1]
        prev = x.new_zeros(C, W - 1) if initial_state is None else initial_state[n].to(x.dtype)
        ext = torch.cat((prev, x[a:b].t()), dim=1)  # [C, W - 1 + L]
        for t in range(b - a):
            y[a + t] = (ext[:, t : t + W] * weight).sum(-1)
        finals[n] = ext[:, ext.shape[1] - (W - 1):]
    return (F.silu(y) if silu else y), finals


def expert_ffn(x: torch.Tensor, w_in: torch.Tensor, w_down: torch.Tensor,
               activation: str) -> torch.Tensor:
    """One expert over rows x [M, D]: "swiglu" (w_in [2 I, D], gate rows then up rows:
    down(silu(gate x) * up x)) or "relu2" (w_in [I, D]: down(relu(up x)^2))."""
    h = F.linear(x, w_in)
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    elif activation == "relu2":
        h = F.relu(h).square()
    else:
        raise ValueError(f"activation must be 'swiglu' or 'relu2', got {activation!r}")
    return F.linear(h, w_down)


def moe_experts_ref(h: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                    w_in: torch.Tensor, w_down: torch.Tensor, activation: str) -> torch.Tensor:
    """The routed sum of a mixture-of-experts layer, token by token: out[n] = sum_j
    weights[n, j] * expert_{index[n, j]}(h[n]) (h [N, D]; weights, index [N, top_k];
    w_in [E, I or 2 I, D], w_down [E, D_out, I]). Returns [N, D_out] fp32."""
    out = torch.zeros(h.shape[0], w_down.shape[1], dtype=torch.float32, device=h.device)
    for n in range(h.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[n, j])
            y = expert_ffn(h[n : n + 1], w_in[e], w_down[e], activation)[0]
            out[n] += (y * weights[n, j]).float()
    return out
