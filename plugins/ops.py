"""The custom operators, registered with `torch.library` under the `suffixreplay` namespace.

Two registrations per operator:
- `suffixreplay::<name>`: an opaque custom op (CPU implementation in `plugins/cpu.py`, fake
  implementation for export). AOTInductor compiles it into CPU engines as a call into the
  operator registry, like a TensorRT plugin; importing `plugins` registers it.
- `suffixreplay::<name>_triton`: a `triton_op` whose body launches the Triton kernel through
  `wrap_triton`, so `torch.export` sees the kernel and AOTInductor embeds it in CUDA engines.
  Registered only where the `triton` package imports.

Callers use the Python entry points below (`gated_delta_scan`, `ssd_scan` (Mamba2),
`causal_conv1d`, `anchor_capture`, `moe_experts` (the routed experts of mixture-of-experts
layers)), which pick the Triton form for CUDA tensors when it exists.
`gated_delta_scan_snap` / `ssd_scan_snap` (the scans plus states at given offsets, for
mid-step snapshots in compiled CPU engines) have the opaque form only.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from plugins import cpu

NAMESPACE = "suffixreplay"


# Opaque operators (CPU engines, and any device as a fallback) -------------------------------
@torch.library.custom_op(f"{NAMESPACE}::gated_delta_scan", mutates_args=())
def _gated_delta_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                      cu_seqlens: Tensor, initial_state: Tensor | None,
                      scale: float) -> tuple[Tensor, Tensor]:
    return cpu.gated_delta_scan_cpu(q, k, v, g, beta, cu_seqlens, initial_state, scale)


@_gated_delta_scan.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    N = cu_seqlens.shape[0] - 1
    return torch.empty_like(v), v.new_empty(N, v.shape[1], k.shape[2], v.shape[2],
                                            dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::gated_delta_scan_snap", mutates_args=())
def _gated_delta_scan_snap(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           cu_seqlens: Tensor, initial_state: Tensor | None,
                           snap_offsets: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return cpu.gated_delta_scan_snap_cpu(q, k, v, g, beta, cu_seqlens, initial_state,
                                         snap_offsets, scale)


@_gated_delta_scan_snap.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, snap_offsets, scale):
    N = cu_seqlens.shape[0] - 1
    state = v.new_empty(N, v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
    return torch.empty_like(v), state, torch.empty_like(state)


@torch.library.custom_op(f"{NAMESPACE}::ssd_scan", mutates_args=())
def _ssd_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, cu_seqlens: Tensor,
              initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    return cpu.ssd_scan_cpu(q, k, v, g, cu_seqlens, initial_state)


@_ssd_scan.register_fake
def _(q, k, v, g, cu_seqlens, initial_state):
    N = cu_seqlens.shape[0] - 1
    return torch.empty_like(v), v.new_empty(N, v.shape[1], k.shape[2], v.shape[2],
                                            dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::ssd_scan_snap", mutates_args=())
def _ssd_scan_snap(q: Tensor, k: Tensor, v: Tensor, g: Tensor, cu_seqlens: Tensor,
                   initial_state: Tensor | None,
                   snap_offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return cpu.ssd_scan_snap_cpu(q, k, v, g, cu_seqlens, initial_state, snap_offsets)


@_ssd_scan_snap.register_fake
def _(q, k, v, g, cu_seqlens, initial_state, snap_offsets):
    N = cu_seqlens.shape[0] - 1
    state = v.new_empty(N, v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
    return torch.empty_like(v), state, torch.empty_like(state)


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d", mutates_args=())
def _causal_conv1d(x: Tensor, weight: Tensor, cu_seqlens: Tensor, initial_state: Tensor | None,
                   silu: bool) -> tuple[Tensor, Tensor]:
    return cpu.causal_conv1d_cpu(x, weight, cu_seqlens, initial_state, silu)


@_causal_conv1d.register_fake
def _(x, weight, cu_seqlens, initial_state, silu):
    N = cu_seqlens.shape[0] - 1
    return torch.empty_like(x), x.new_empty(N, x.shape[1], weight.shape[1] - 1)


@torch.library.custom_op(f"{NAMESPACE}::anchor_capture", mutates_args=("pool",))
def _anchor_capture(hidden: Tensor, src: Tensor, dst: Tensor, pool: Tensor) -> None:
    cpu.anchor_capture_cpu(hidden, src, dst, pool)


@_anchor_capture.register_fake
def _(hidden, src, dst, pool):
    return None


@torch.library.custom_op(f"{NAMESPACE}::moe_experts", mutates_args=())
def _moe_experts(h: Tensor, weights: Tensor, index: Tensor, w_in: Tensor, w_down: Tensor,
                 activation: str) -> Tensor:
    return cpu.moe_experts_cpu(h, weights, index, w_in, w_down, activation)


@_moe_experts.register_fake
def _(h, weights, index, w_in, w_down, activation):
    return h.new_empty(h.shape[0], w_down.shape[1], dtype=torch.float32)


class MoEPlan(NamedTuple):
    sorted_pairs: Tensor  # [blocks * BM]: (token, choice) pair ids by expert; P = padding
    block_expert: Tensor  # [blocks]: each block's expert; E = an unused block


MOE_BM = 16  # rows of a grouped-product block (each expert's run padded to a multiple)


def moe_plan(index: Tensor, num_experts: int, bm: int) -> MoEPlan:
    """The grouped products' schedule for chosen experts `index` [N, top_k], in tensor ops
    with shapes fixed by N, top_k, E and bm (no host sync, so it exports): the pairs sorted
    by expert (stable), each expert's run padded to a multiple of bm, the expert of each
    bm-row block."""
    flat = index.reshape(-1).long()
    P, E = flat.shape[0], num_experts
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    pad_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat.index_select(0, order)
    rank = torch.arange(P, device=flat.device) - (counts.cumsum(0) - counts).index_select(
        0, expert)
    blocks = (P + E * (bm - 1) + bm - 1) // bm
    sorted_pairs = torch.full((blocks * bm,), P, dtype=torch.long, device=flat.device)
    sorted_pairs.index_copy_(0, (pad_end - padded).index_select(0, expert) + rank, order)
    starts = torch.arange(blocks, device=flat.device) * bm
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    return MoEPlan(sorted_pairs, block_expert)


# Triton operators (CUDA engines) ------------------------------------------------------------
def _register_triton_ops() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    from torch.library import triton_op, wrap_triton

    from plugins import triton_kernels as tk

    def launch_scan(q, k, v, g, beta, cu_seqlens, initial_state, scale, delta):
        H, K, V = q.shape[1], q.shape[2], v.shape[2]
        N = cu_seqlens.shape[0] - 1
        o = torch.empty_like(v)
        ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
        BK = triton.next_power_of_2(K)
        BV = min(triton.next_power_of_2(V), 32)
        h0 = initial_state.float().contiguous() if initial_state is not None else ht
        wrap_triton(tk.linear_scan_kernel)[(triton.cdiv(V, BV), N * H)](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            h0, cu_seqlens, o, ht, H=H, K=K, V=V, BK=BK, BV=BV,
            HAS_H0=initial_state is not None, SCALE=scale, DELTA=delta)
        return o, ht

    @triton_op(f"{NAMESPACE}::gated_delta_scan_triton", mutates_args=())
    def gated_delta_scan_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                cu_seqlens: Tensor, initial_state: Tensor | None,
                                scale: float) -> tuple[Tensor, Tensor]:
        return launch_scan(q, k, v, g, beta, cu_seqlens, initial_state, scale, True)

    @triton_op(f"{NAMESPACE}::ssd_scan_triton", mutates_args=())
    def ssd_scan_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, cu_seqlens: Tensor,
                        initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
        return launch_scan(q, k, v, g, g, cu_seqlens, initial_state, 1.0, False)

    @triton_op(f"{NAMESPACE}::causal_conv1d_triton", mutates_args=())
    def causal_conv1d_triton(x: Tensor, weight: Tensor, cu_seqlens: Tensor,
                             initial_state: Tensor | None, silu: bool) -> tuple[Tensor, Tensor]:
        C, W = weight.shape
        N = cu_seqlens.shape[0] - 1
        y = torch.empty_like(x)
        st = torch.empty(N, C, W - 1, dtype=x.dtype, device=x.device)
        s0 = initial_state.contiguous() if initial_state is not None else st
        BC = min(triton.next_power_of_2(C), 128)
        wrap_triton(tk.causal_conv1d_kernel)[(N, triton.cdiv(C, BC))](
            x.contiguous(), weight.contiguous(), s0, cu_seqlens, C, y, st, W=W, BC=BC,
            HAS_S0=initial_state is not None, SILU=silu)
        return y, st

    @triton_op(f"{NAMESPACE}::moe_experts_triton", mutates_args=())
    def moe_experts_triton(h: Tensor, weights: Tensor, index: Tensor, w_in: Tensor,
                           w_down: Tensor, activation: str) -> Tensor:
        N, top_k = index.shape
        E, D, F, Dout = w_in.shape[0], h.shape[1], w_down.shape[2], w_down.shape[1]
        plan = moe_plan(index, E, MOE_BM)
        blocks = plan.block_expert.shape[0]
        P = N * top_k
        inter = torch.empty(blocks * MOE_BM, F, dtype=torch.float32, device=h.device)
        pair_out = torch.zeros(P, Dout, dtype=torch.float32, device=h.device)
        precision = "ieee" if w_in.dtype == torch.float32 else "tf32"
        wrap_triton(tk.moe_up_kernel)[(blocks, triton.cdiv(F, 64))](
            h.contiguous(), w_in.contiguous(), plan.sorted_pairs, plan.block_expert, inter,
            D, F, P, E, TOP_K=top_k, SWIGLU=activation == "swiglu", BM=MOE_BM, BN=64, BK=32,
            PRECISION=precision)
        wrap_triton(tk.moe_down_kernel)[(blocks, triton.cdiv(Dout, 64))](
            inter, w_down.contiguous(), weights.contiguous().view(-1), plan.sorted_pairs,
            plan.block_expert, pair_out, F, Dout, P, E, BM=MOE_BM, BN=64, BK=32,
            PRECISION=precision)
        return pair_out.view(N, top_k, Dout).sum(1)

    @triton_op(f"{NAMESPACE}::anchor_capture_triton", mutates_args={"pool"})
    def anchor_capture_triton(hidden: Tensor, src: Tensor, dst: Tensor, pool: Tensor) -> None:
        M, D = src.shape[0], hidden.shape[1]
        BD = min(triton.next_power_of_2(D), 1024)
        wrap_triton(tk.anchor_capture_kernel)[(M, triton.cdiv(D, BD))](
            hidden.contiguous(), src, dst, D, pool, BD=BD)

    return True


TRITON_OPS = _register_triton_ops()


def triton_available() -> bool:
    return TRITON_OPS


def _use_triton(t: Tensor) -> bool:
    if not TRITON_OPS:
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("SUFFIXREPLAY_TRITON_ON_CPU") == "1"


# Entry points ---------------------------------------------------------------------------------
def gated_delta_scan(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None):
    """Chunked-equivalent gated delta rule over packed sequences (see plugins/reference.py)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    op = (torch.ops.suffixreplay.gated_delta_scan_triton if _use_triton(q)
          else torch.ops.suffixreplay.gated_delta_scan)
    return op(q, k, v, g, beta, cu_seqlens, initial_state, scale)


def gated_delta_scan_snap(q, k, v, g, beta, cu_seqlens, initial_state, snap_offsets,
                          scale=None):
    """`gated_delta_scan` plus each sequence's state after its first `snap_offsets[n]`
    tokens (multiples of 64; 0: its final state): mid-step snapshots for compiled CPU
    engines. One form only (the CPU operator, vectorised PyTorch): CUDA engines end a step
    where a state is to be saved instead, as the eager CUDA path with flash-linear-attention
    does."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.suffixreplay.gated_delta_scan_snap(q, k, v, g, beta, cu_seqlens,
                                                        initial_state, snap_offsets, scale)


def ssd_scan(q, k, v, g, cu_seqlens, initial_state=None):
    """The Mamba2 scan over packed sequences (see `plugins/reference.py`, `ssd_scan_ref`)."""
    op = (torch.ops.suffixreplay.ssd_scan_triton if _use_triton(q)
          else torch.ops.suffixreplay.ssd_scan)
    return op(q, k, v, g, cu_seqlens, initial_state)


def ssd_scan_snap(q, k, v, g, cu_seqlens, initial_state, snap_offsets):
    """`ssd_scan` plus mid-step states, as `gated_delta_scan_snap` (CPU form only)."""
    return torch.ops.suffixreplay.ssd_scan_snap(q, k, v, g, cu_seqlens, initial_state,
                                                snap_offsets)


def causal_conv1d(x, weight, cu_seqlens, initial_state=None, silu=True):
    op = (torch.ops.suffixreplay.causal_conv1d_triton if _use_triton(x)
          else torch.ops.suffixreplay.causal_conv1d)
    return op(x, weight, cu_seqlens, initial_state, silu)


def anchor_capture(hidden, src, dst, pool) -> None:
    op = (torch.ops.suffixreplay.anchor_capture_triton if _use_triton(hidden)
          else torch.ops.suffixreplay.anchor_capture)
    op(hidden, src, dst, pool)


def moe_experts(h, weights, index, w_in, w_down, activation):
    """The routed sum of a mixture-of-experts layer over stacked expert weights (see
    `plugins/reference.py`, `moe_experts_ref`; `activation` "swiglu" or "relu2"), fp32.
    CPU form: each expert that got tokens runs one product over them (a host-side loop);
    Triton form (CUDA): two grouped-product kernels over the pairs sorted by expert, planned
    by `moe_plan` in tensor ops, so nothing waits on the host."""
    if activation not in ("swiglu", "relu2"):
        raise ValueError(f"activation must be 'swiglu' or 'relu2', got {activation!r}")
    op = (torch.ops.suffixreplay.moe_experts_triton if _use_triton(h)
          else torch.ops.suffixreplay.moe_experts)
    return op(h, weights, index, w_in, w_down, activation)
