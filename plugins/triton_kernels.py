"""OpenAI Triton kernels for the operators (CUDA; on the CPU through TRITON_INTERPRET=1).

Written against plain pointers, integer scalars and constexprs only, with parameters ordered
(inputs, integer scalars, outputs) as TensorRT's ahead-of-time plugins launch them, so the same
source compiles to the PTX a TensorRT quickly-deployable plugin embeds (`plugins/tensorrt.py`).
Layouts are the packed variable-length ones of `plugins/reference.py`, contiguous.

- `linear_scan_kernel`: the gated delta rule (DELTA) or the Mamba2 scan (not DELTA: no erase,
  no beta, SCALE 1). Grid (V blocks, N * H). Each program keeps a [K, BV] slice of one head's
  state in registers and walks its sequence token by token (the value columns of both
  recurrences are independent, so V splits across programs without communication).
- `causal_conv1d_kernel`: grid (N, C blocks); each program walks its sequence, reading the
  W - 1 inputs before the sequence from the carried state, and writes the new state.
- `anchor_capture_kernel`: grid (M, D blocks); row gather-scatter with a dtype cast.
- `moe_up_kernel` / `moe_down_kernel`: a mixture-of-experts layer's routed experts as two
  grouped products over (token, choice) pairs sorted by expert, each expert's run padded to
  BM rows (`plugins.ops.moe_plan`: `block_expert` [blocks], `sorted_pairs` [blocks * BM],
  pair id P marks padding). Up: grid (blocks, F blocks; F the experts' width), the expert's
  input product and activation (SwiGLU: gate and up rows; else squared ReLU) into fp32
  `inter`. Down: grid (blocks, D_out blocks), the output product times the pair's routing
  weight into `pair_out` [P, D_out]; the caller sums each token's top-k rows (no atomics:
  deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def linear_scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, cu_ptr, o_ptr, ht_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, SCALE: tl.constexpr,
    DELTA: tl.constexpr,
):
    """S <- exp(g) S, then the delta rule's erase-and-write (DELTA) or S += k v^T; o = S^T q.
    beta_ptr is not read without DELTA."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0_ptr + state_off, mask=m_kv, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        row = t * H + i_h
        b_k = tl.load(k_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_q = tl.load(q_ptr + row * K + o_k, mask=m_k, other=0.0).to(tl.float32) * SCALE
        b_v = tl.load(v_ptr + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g_ptr + row).to(tl.float32)
        S = S * tl.exp(b_g)
        if DELTA:
            b_beta = tl.load(beta_ptr + row).to(tl.float32)
            b_v = (b_v - tl.sum(S * b_k[:, None], axis=0)) * b_beta
        S = S + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(S * b_q[:, None], axis=0)
        tl.store(o_ptr + row * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    tl.store(ht_ptr + state_off, S, mask=m_kv)


@triton.jit
def causal_conv1d_kernel(
    x_ptr, w_ptr, s0_ptr, cu_ptr, C, y_ptr, st_ptr,
    W: tl.constexpr, BC: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    state_base = s0_ptr + i_n.to(tl.int64) * C * (W - 1) + o_c * (W - 1)
    for t in range(bos, eos):
        acc = tl.zeros([BC], dtype=tl.float32)
        for w in tl.static_range(W):
            # absolute row (as a vector, so masks broadcast); rows before `bos` come from state
            src = tl.zeros([BC], dtype=tl.int64) + (t - (W - 1) + w)
            wv = tl.load(w_ptr + o_c * W + w, mask=m_c, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + src * C + o_c, mask=m_c & (src >= bos), other=0.0)
            if HAS_S0:
                sv = tl.load(state_base + (W - 1) + (src - bos), mask=m_c & (src < bos),
                             other=0.0)
                xv = xv + sv
            acc += wv * xv.to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + t * C + o_c, acc.to(y_ptr.dtype.element_ty), mask=m_c)
    out_base = st_ptr + i_n.to(tl.int64) * C * (W - 1) + o_c * (W - 1)
    for j in tl.static_range(W - 1):
        src = tl.zeros([BC], dtype=tl.int64) + (eos - (W - 1) + j)
        xv = tl.load(x_ptr + src * C + o_c, mask=m_c & (src >= bos), other=0.0)
        if HAS_S0:
            xv = xv + tl.load(state_base + (W - 1) + (src - bos), mask=m_c & (src < bos),
                              other=0.0)
        tl.store(out_base + j, xv.to(st_ptr.dtype.element_ty), mask=m_c)


@triton.jit
def anchor_capture_kernel(h_ptr, src_ptr, dst_ptr, D, pool_ptr, BD: tl.constexpr):
    i = tl.program_id(0)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m = o_d < D
    s = tl.load(src_ptr + i).to(tl.int64)
    d = tl.load(dst_ptr + i).to(tl.int64)
    row = tl.load(h_ptr + s * D + o_d, mask=m, other=0.0)
    tl.store(pool_ptr + d * D + o_d, row.to(pool_ptr.dtype.element_ty), mask=m)


@triton.jit
def _moe_block(pairs_ptr, block_expert_ptr, P, BM: tl.constexpr, BN: tl.constexpr):
    """This program's block of sorted rows: (its expert, the rows, their pair ids, which rows
    are real pairs, the output columns of this program's tile)."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    o_m = b * BM + tl.arange(0, BM)
    pair = tl.load(pairs_ptr + o_m).to(tl.int64)
    return e, o_m, pair, pair < P, tl.program_id(1) * BN + tl.arange(0, BN)


@triton.jit
def moe_up_kernel(
    h_ptr, w_ptr, pairs_ptr, block_expert_ptr, inter_ptr, D, F, P, E,
    TOP_K: tl.constexpr, SWIGLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """inter[r] = act(W_in[e] h[token(r)]) for the BM sorted rows r of block b (expert e)."""
    e, o_m, pair, m_m, o_n = _moe_block(pairs_ptr, block_expert_ptr, P, BM, BN)
    if e < E:
        token = tl.where(m_m, pair // TOP_K, 0)
        m_n = o_n < F
        rows = 2 * F if SWIGLU else F
        w_base = w_ptr + e * rows * D
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < D
            a = tl.load(h_ptr + token[:, None] * D + o_k[None, :],
                        mask=m_m[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            m_w = m_k[:, None] & m_n[None, :]
            w = tl.load(w_base + o_n[None, :] * D + o_k[:, None], mask=m_w,
                        other=0.0).to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if SWIGLU:
                wu = tl.load(w_base + (F + o_n[None, :]) * D + o_k[:, None], mask=m_w,
                             other=0.0).to(tl.float32)
                acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
        if SWIGLU:
            out = acc * tl.sigmoid(acc) * acc_up
        else:
            out = tl.maximum(acc, 0.0)
            out = out * out
        tl.store(inter_ptr + o_m.to(tl.int64)[:, None] * F + o_n[None, :], out,
                 mask=m_m[:, None] & m_n[None, :])


@triton.jit
def moe_down_kernel(
    inter_ptr, w_ptr, weights_ptr, pairs_ptr, block_expert_ptr, pair_out_ptr, F, DOUT, P, E,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """pair_out[pair(r)] = weight(pair(r)) * W_down[e] inter[r] for block b's rows r."""
    e, o_m, pair, m_m, o_n = _moe_block(pairs_ptr, block_expert_ptr, P, BM, BN)
    if e < E:
        m_n = o_n < DOUT
        w_base = w_ptr + e * DOUT * F
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, F, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < F
            a = tl.load(inter_ptr + o_m.to(tl.int64)[:, None] * F + o_k[None, :],
                        mask=m_m[:, None] & m_k[None, :], other=0.0)
            w = tl.load(w_base + o_n[None, :] * F + o_k[:, None],
                        mask=m_k[:, None] & m_n[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        weight = tl.load(weights_ptr + tl.where(m_m, pair, 0), mask=m_m, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
        tl.store(pair_out_ptr + pair[:, None] * DOUT + o_n[None, :], acc,
                 mask=m_m[:, None] & m_n[None, :])
