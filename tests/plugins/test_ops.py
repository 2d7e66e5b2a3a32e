"""Each operator (CPU implementation and Triton kernel) against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plugins
from plugins import reference as ref

triton_ops = pytest.mark.skipif(not plugins.triton_available(), reason="triton not installed")
LENGTHS = [[1], [5, 0, 17, 3], [70, 1, 64], [2, 2], [1, 1, 1], [2, 0]]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _scan_inputs(lengths, H, K, V, seed, with_state):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, H, V, generator=g)
    gate = -torch.rand(T, H, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    h0 = torch.randn(len(lengths), H, K, V, generator=g) if with_state else None
    return q, k, v, gate, beta, _cu(lengths), h0


SCAN_CASES = [(lengths, hkv, with_state) for lengths in LENGTHS
              for hkv in [(2, 16, 16), (3, 16, 24), (1, 32, 8)] for with_state in (False, True)]


@pytest.mark.parametrize("lengths,hkv,with_state", SCAN_CASES)
def test_gated_delta_scan_cpu_matches_reference(lengths, hkv, with_state):
    q, k, v, g, beta, cu, h0 = _scan_inputs(lengths, *hkv, seed=len(lengths), with_state=with_state)
    want_o, want_s = ref.gated_delta_scan_ref(q, k, v, g, beta, cu, h0, 0.3)
    o, s = torch.ops.suffixreplay.gated_delta_scan(q, k, v, g, beta, cu, h0, 0.3)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=2e-5, rtol=1e-4)


@triton_ops
@pytest.mark.parametrize("lengths,hkv,with_state", SCAN_CASES[::2] + SCAN_CASES[1::6])
def test_gated_delta_scan_triton_matches_reference(lengths, hkv, with_state):
    q, k, v, g, beta, cu, h0 = _scan_inputs(lengths, *hkv, seed=7, with_state=with_state)
    want_o, want_s = ref.gated_delta_scan_ref(q, k, v, g, beta, cu, h0, 0.3)
    o, s = torch.ops.suffixreplay.gated_delta_scan_triton(q, k, v, g, beta, cu, h0, 0.3)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=2e-5, rtol=1e-4)


def test_gated_delta_scan_equals_one_sequence_at_a_time():
    """Packing must not leak state between neighbouring sequences."""
    lengths = [9, 30, 4]
    q, k, v, g, beta, cu, h0 = _scan_inputs(lengths, 2, 16, 16, seed=3, with_state=True)
    o, s = torch.ops.suffixreplay.gated_delta_scan(q, k, v, g, beta, cu, h0, 0.25)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o1, s1 = torch.ops.suffixreplay.gated_delta_scan(
            q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], _cu([b - a]), h0[n:n + 1], 0.25)
        torch.testing.assert_close(o[a:b], o1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[n], s1[0], atol=1e-5, rtol=1e-5)


def test_gated_delta_scan_bfloat16_inputs():
    q, k, v, g, beta, cu, h0 = _scan_inputs([20, 7], 2, 16, 16, seed=5, with_state=True)
    want_o, want_s = ref.gated_delta_scan_ref(q, k, v, g, beta, cu, h0, 0.25)
    o, s = torch.ops.suffixreplay.gated_delta_scan(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                   g, beta, cu, h0, 0.25)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o.float(), want_o, atol=0.1, rtol=0.05)
    torch.testing.assert_close(s, want_s, atol=0.1, rtol=0.05)


def _conv_inputs(lengths, C, W, seed, with_state):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), C, generator=g)
    w = torch.randn(C, W, generator=g)
    s0 = torch.randn(len(lengths), C, W - 1, generator=g) if with_state else None
    return x, w, _cu(lengths), s0


CONV_CASES = [(lengths, C, W, st, silu) for lengths in LENGTHS for C, W in [(10, 4), (33, 2)]
              for st in (False, True) for silu in (True, False)]


@pytest.mark.parametrize("lengths,C,W,with_state,silu", CONV_CASES)
def test_causal_conv1d_cpu_matches_reference(lengths, C, W, with_state, silu):
    x, w, cu, s0 = _conv_inputs(lengths, C, W, seed=C, with_state=with_state)
    want_y, want_s = ref.causal_conv1d_ref(x, w, cu, s0, silu)
    y, s = torch.ops.suffixreplay.causal_conv1d(x, w, cu, s0, silu)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, want_s)


@triton_ops
@pytest.mark.parametrize("lengths,C,W,with_state,silu", CONV_CASES[::3])
def test_causal_conv1d_triton_matches_reference(lengths, C, W, with_state, silu):
    x, w, cu, s0 = _conv_inputs(lengths, C, W, seed=C + 1, with_state=with_state)
    want_y, want_s = ref.causal_conv1d_ref(x, w, cu, s0, silu)
    y, s = torch.ops.suffixreplay.causal_conv1d_triton(x, w, cu, s0, silu)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, want_s)


def test_conv_state_of_a_short_sequence_keeps_part_of_the_old_state():
    """A sequence shorter than W - 1 shifts its new inputs into the carried state."""
    x, w, cu, s0 = _conv_inputs([1], 4, 4, seed=0, with_state=True)
    _, s = torch.ops.suffixreplay.causal_conv1d(x, w, cu, s0, True)
    torch.testing.assert_close(s[0, :, :2], s0[0, :, 1:])
    torch.testing.assert_close(s[0, :, 2], x[0])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_anchor_capture_matches_reference(pool_dtype, impl):
    if impl == "triton" and not plugins.triton_available():
        pytest.skip("triton not installed")
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 24, generator=g)
    src = torch.tensor([0, 7, 39, 12])
    dst = torch.tensor([5, 0, 9, 2])
    want = torch.randn(11, 24, generator=g).to(pool_dtype)
    got = want.clone()
    ref.anchor_capture_ref(hidden, src, dst, want)
    op = {"cpu": torch.ops.suffixreplay.anchor_capture,
          "triton": torch.ops.suffixreplay.anchor_capture_triton}[impl]
    op(hidden, src, dst, got)
    if impl == "triton" and pool_dtype == torch.bfloat16:
        # Triton's CPU interpreter rounds fp32 -> bf16 by truncation (CUDA rounds to nearest):
        # allow one bf16 step.
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(got, want)
    untouched = [r for r in range(11) if r not in dst.tolist()]
    assert torch.equal(got[untouched], want[untouched])


def test_fake_implementations_give_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(12, 3, 16), torch.empty(12, 3, 16)
        v, g, beta = torch.empty(12, 3, 24), torch.empty(12, 3), torch.empty(12, 3)
        o, s = torch.ops.suffixreplay.gated_delta_scan(q, k, v, g, beta,
                                                       torch.empty(4, dtype=torch.int32),
                                                       None, 0.25)
        y, cs = torch.ops.suffixreplay.causal_conv1d(torch.empty(12, 10), torch.empty(10, 4),
                                                     torch.empty(4, dtype=torch.int32), None, True)
        so, ss, snap = torch.ops.suffixreplay.ssd_scan_snap(
            q, k, v, g, torch.empty(4, dtype=torch.int32), None,
            torch.empty(3, dtype=torch.long))
    assert tuple(o.shape) == (12, 3, 24) and tuple(s.shape) == (3, 3, 16, 24)
    assert s.dtype == torch.float32
    assert tuple(so.shape) == (12, 3, 24) and tuple(ss.shape) == tuple(snap.shape) == (3, 3, 16, 24)
    assert tuple(y.shape) == (12, 10) and tuple(cs.shape) == (3, 10, 3)
    with FakeTensorMode():
        m = torch.ops.suffixreplay.moe_experts(
            torch.empty(5, 8), torch.empty(5, 2), torch.empty(5, 2, dtype=torch.long),
            torch.empty(4, 6, 8), torch.empty(4, 7, 6), "relu2")
    assert tuple(m.shape) == (5, 7) and m.dtype == torch.float32


# The Mamba2 (SSD) scan: no erase, no beta, no scale; k and q are B and C expanded to the
# heads, v = dt * x, g = dt * A.
def _ssd_inputs(lengths, H, N, P, seed, with_state):
    q, k, v, g, _, cu, h0 = _scan_inputs(lengths, H, N, P, seed, with_state)
    return q * 2, k, v, g, cu, h0


SSD_CASES = [(lengths, hnp, with_state) for lengths in LENGTHS
             for hnp in [(2, 16, 16), (4, 8, 24)] for with_state in (False, True)]


@pytest.mark.parametrize("lengths,hnp,with_state", SSD_CASES)
def test_ssd_scan_cpu_matches_reference(lengths, hnp, with_state):
    q, k, v, g, cu, h0 = _ssd_inputs(lengths, *hnp, seed=len(lengths), with_state=with_state)
    want_o, want_s = ref.ssd_scan_ref(q, k, v, g, cu, h0)
    o, s = torch.ops.suffixreplay.ssd_scan(q, k, v, g, cu, h0)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=2e-5, rtol=1e-4)


@triton_ops
@pytest.mark.parametrize("lengths,hnp,with_state", SSD_CASES[::3])
def test_ssd_scan_triton_matches_reference(lengths, hnp, with_state):
    q, k, v, g, cu, h0 = _ssd_inputs(lengths, *hnp, seed=8, with_state=with_state)
    want_o, want_s = ref.ssd_scan_ref(q, k, v, g, cu, h0)
    o, s = torch.ops.suffixreplay.ssd_scan_triton(q, k, v, g, cu, h0)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=2e-5, rtol=1e-4)


def test_ssd_scan_is_not_the_delta_rule():
    """The reference itself: the Mamba2 update has no erase term (the two scans differ on
    the same inputs), and a position with g = 0 and v = 0 leaves the state as it was."""
    q, k, v, g, cu, h0 = _ssd_inputs([12], 2, 16, 16, seed=2, with_state=True)
    _, s = ref.ssd_scan_ref(q, k, v, g, cu, h0)
    _, s_delta = ref.gated_delta_scan_ref(q, k, v, g, torch.ones_like(g), cu, h0, 1.0)
    assert not torch.allclose(s, s_delta, atol=1e-3)
    z = torch.zeros(1, *v.shape[1:])
    _, s_pad = ref.ssd_scan_ref(torch.cat([q, q[:1]]), torch.cat([k, k[:1]]),
                                torch.cat([v, z]), torch.cat([g, torch.zeros(1, 2)]),
                                _cu([13]), h0)
    torch.testing.assert_close(s_pad, s)


SNAP_SCANS = {  # (the scan with snapshots, its reference), as functions of the inputs
    "gated_delta": (
        lambda t, cu, h0, off: torch.ops.suffixreplay.gated_delta_scan_snap(*t, cu, h0, off, 0.3),
        lambda t, cu, h0: ref.gated_delta_scan_ref(*t, cu, h0, 0.3)),
    "ssd": (lambda t, cu, h0, off: torch.ops.suffixreplay.ssd_scan_snap(*t, cu, h0, off),
            lambda t, cu, h0: ref.ssd_scan_ref(*t, cu, h0)),
}


@pytest.mark.parametrize("scan", list(SNAP_SCANS))
@pytest.mark.parametrize("with_state", [False, True])
def test_scan_snapshots_are_the_states_of_the_prefixes(scan, with_state):
    """gated_delta_scan_snap / ssd_scan_snap: outputs and final states as the plain scans;
    the snapshot of a sequence is the final state of scanning its first `offset` tokens
    alone (offset 0: its final state)."""
    lengths, offsets = [200, 70, 130, 64], [128, 0, 64, 64]
    q, k, v, g, beta, cu, h0 = _scan_inputs(lengths, 2, 16, 24, seed=5, with_state=with_state)
    inputs = (q, k, v, g, beta) if scan == "gated_delta" else (q * 2, k, v, g)
    snap_scan, ref_scan = SNAP_SCANS[scan]
    o, s, snap = snap_scan(inputs, cu, h0, torch.tensor(offsets))
    want_o, want_s = ref_scan(inputs, cu, h0)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=2e-5, rtol=1e-4)
    for n, (a, m) in enumerate(zip(cu[:-1].tolist(), offsets)):
        if m == 0:
            torch.testing.assert_close(snap[n], s[n])
            continue
        init = h0[n:n + 1] if with_state else None
        _, want = ref_scan(tuple(t[a:a + m] for t in inputs), _cu([m]), init)
        torch.testing.assert_close(snap[n], want[0], atol=2e-5, rtol=1e-4)
        if m < lengths[n]:  # a state of its own, not the final one
            assert not torch.allclose(snap[n], s[n])
    with pytest.raises(ValueError, match="within their sequences"):
        snap_scan(inputs, cu, h0, torch.tensor([0, 128, 0, 0]))
    with pytest.raises(ValueError, match="multiples of 64"):
        snap_scan(inputs, cu, h0, torch.tensor([100, 0, 0, 0]))


# Mixture-of-experts routed sum ---------------------------------------------------------------
def _moe_inputs(N, E, top_k, D, F_, activation, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen).to(dtype)
    # Experts E - 1 and E - 2 are never chosen: some experts get no tokens.
    index = torch.stack([torch.randperm(E - 2, generator=gen)[:top_k] for _ in range(N)]) \
        if N else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(N, top_k, generator=gen)
    rows = 2 * F_ if activation == "swiglu" else F_
    w_in = (torch.randn(E, rows, D, generator=gen) / D ** 0.5).to(dtype)
    w_down = (torch.randn(E, D + 3, F_, generator=gen) / F_ ** 0.5).to(dtype)
    return h, weights, index, w_in, w_down


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("N,top_k", [(0, 2), (1, 1), (7, 2), (40, 3)])
def test_moe_experts_cpu_matches_reference(activation, N, top_k):
    inputs = _moe_inputs(N, 8, top_k, 16, 12, activation, seed=N + top_k)
    got = plugins.moe_experts(*inputs, activation)
    want = ref.moe_experts_ref(*inputs, activation)
    assert got.dtype == torch.float32 and got.shape == (N, 19)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if N:
        assert want.abs().sum() > 0


@triton_ops
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("N,top_k,E", [(1, 1, 8), (7, 2, 8), (40, 3, 6)])
def test_moe_experts_triton_matches_reference(activation, N, top_k, E):
    """The grouped-product kernels (experts' runs padded to 16-row blocks, widths and the
    hidden size not multiples of the tiles) against the token-by-token reference."""
    inputs = _moe_inputs(N, E, top_k, 40, 24, activation, seed=N + E)
    got = torch.ops.suffixreplay.moe_experts_triton(*inputs, activation)
    want = ref.moe_experts_ref(*inputs, activation)
    assert got.dtype == torch.float32 and got.shape == (N, 43)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_moe_plan_sorts_pairs_by_expert_in_padded_blocks():
    from plugins.ops import moe_plan

    index = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5 -> experts 2,0,2,1,0,2
    plan = moe_plan(index, 4, 4)
    P = 6
    # expert 0: pairs 1, 4; expert 1: pair 3; expert 2: pairs 0, 2, 5; each run padded to 4
    assert plan.sorted_pairs[:12].tolist() == [1, 4, P, P, 3, P, P, P, 0, 2, 5, P]
    assert plan.block_expert.tolist()[:3] == [0, 1, 2]
    assert all(e == 4 for e in plan.block_expert.tolist()[3:])  # unused blocks
    assert bool((plan.sorted_pairs[12:] == P).all())


def test_moe_experts_activations_differ_and_bad_ones_are_refused():
    h, weights, index, w_in, w_down = _moe_inputs(5, 6, 2, 8, 4, "swiglu", seed=3)
    swiglu = plugins.moe_experts(h, weights, index, w_in, w_down, "swiglu")
    relu2 = plugins.moe_experts(h, weights, index, w_in[:, :4], w_down, "relu2")
    assert (swiglu - relu2).abs().max() > 1e-3
    with pytest.raises(ValueError, match="activation"):
        plugins.moe_experts(h, weights, index, w_in, w_down, "gelu")


def test_moe_experts_bfloat16_inputs():
    inputs = _moe_inputs(9, 6, 2, 16, 8, "relu2", seed=5, dtype=torch.bfloat16)
    got = plugins.moe_experts(*inputs, "relu2")
    want = ref.moe_experts_ref(*(t.float() if t.is_floating_point() else t for t in inputs),
                               "relu2")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_moe_experts_over_stacked_weights_is_the_layer(family):
    """A MoE layer with the operator over its `stacked_weights()` (what the packed graphs
    run) gives its own output (the loop over its expert modules)."""
    from backend.model.mlp import NemotronMoE, SparseMoE

    torch.manual_seed(0)
    moe = {"num_experts": 8, "top_k": 2, "norm_topk_prob": True, "intermediate_size": 12,
           "shared_intermediate_size": 20, "n_group": 2, "topk_group": 1,
           "routed_scaling_factor": 2.5, "latent_size": 10}
    layer = SparseMoE(16, moe) if family == "qwen3_next" else NemotronMoE(16, moe)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    w_in, w_down = layer.stacked_weights()
    x = torch.randn(2, 9, 16)
    got = layer(x, experts=lambda h, w, i: plugins.moe_experts(h, w, i, w_in, w_down,
                                                               layer.activation))
    torch.testing.assert_close(got, layer(x), atol=1e-5, rtol=1e-5)
