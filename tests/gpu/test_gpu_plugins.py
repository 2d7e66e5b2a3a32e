"""GPU checks of the operators and compiled engines (run by tests/gpu/run.sh on a CUDA machine;
skipped everywhere else)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plugins
from plugins import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _scan_inputs(lengths, H, K, V, device):
    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v, gate = torch.randn(T, H, V, generator=g), -torch.rand(T, H, generator=g) * 2
    beta, h0 = torch.rand(T, H, generator=g), torch.randn(len(lengths), H, K, V, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cpu = (q, k, v, gate, beta, cu, h0)
    return cpu, tuple(t.to(device) for t in cpu)


@pytest.mark.parametrize("hkv", [(4, 64, 64), (8, 128, 128), (2, 32, 64)])
def test_triton_scan_on_cuda_matches_reference(hkv):
    cpu, dev = _scan_inputs([100, 1, 64, 0, 7], *hkv, "cuda")
    want_o, want_s = ref.gated_delta_scan_ref(*cpu, 0.3)
    o, s = torch.ops.suffixreplay.gated_delta_scan_triton(*dev, 0.3)
    torch.testing.assert_close(o.cpu(), want_o, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(s.cpu(), want_s, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("hnp", [(8, 128, 64), (32, 64, 128)])
def test_triton_ssd_scan_on_cuda_matches_reference(hnp):
    """The Mamba2 form of the scan kernel (DELTA off; Nemotron-H-8B-like: 128 heads of 64
    with d_state 128 would be (128, 128, 64))."""
    (q, k, v, gate, _, cu, h0), dev = _scan_inputs([100, 1, 64, 0, 7], *hnp, "cuda")
    want_o, want_s = ref.ssd_scan_ref(q, k, v, gate, cu, h0)
    o, s = torch.ops.suffixreplay.ssd_scan_triton(dev[0], dev[1], dev[2], dev[3], dev[5],
                                                  dev[6])
    torch.testing.assert_close(o.cpu(), want_o, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(s.cpu(), want_s, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.float32),
                                              ("relu2", torch.float32),
                                              ("swiglu", torch.bfloat16)])
def test_triton_moe_experts_on_cuda_matches_reference(activation, dtype):
    """The grouped-product MoE kernels at a Qwen3-Next-like width (512 experts of 512, top 10,
    hidden 1024 here) against the reference (fp32) on the CPU."""
    g = torch.Generator().manual_seed(0)
    N, E, top_k, D, F_ = 37, 512, 10, 1024, 512
    h = torch.randn(N, D, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(N)])
    weights = torch.rand(N, top_k, generator=g)
    w_in = torch.randn(E, 2 * F_ if activation == "swiglu" else F_, D, generator=g) / D ** 0.5
    w_down = torch.randn(E, D, F_, generator=g) / F_ ** 0.5
    cpu = (h.to(dtype).float(), weights, index, w_in.to(dtype).float(), w_down.to(dtype).float())
    want = ref.moe_experts_ref(*cpu, activation)
    got = torch.ops.suffixreplay.moe_experts_triton(
        h.to("cuda", dtype), weights.cuda(), index.cuda(), w_in.to("cuda", dtype),
        w_down.to("cuda", dtype), activation)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


def test_triton_conv_and_capture_on_cuda_match_reference():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(90, 300, generator=g), torch.randn(300, 4, generator=g)
    s0 = torch.randn(3, 300, 3, generator=g)
    cu = torch.tensor([0, 50, 51, 90], dtype=torch.int32)
    want_y, want_s = ref.causal_conv1d_ref(x, w, cu, s0, True)
    y, s = torch.ops.suffixreplay.causal_conv1d_triton(x.cuda(), w.cuda(), cu.cuda(), s0.cuda(),
                                                       True)
    torch.testing.assert_close(y.cpu(), want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.cpu(), want_s)
    pool, want = torch.zeros(20, 300, device="cuda"), torch.zeros(20, 300)
    src, dst = torch.tensor([3, 80, 0]), torch.tensor([19, 0, 5])
    ref.anchor_capture_ref(x, src, dst, want)
    torch.ops.suffixreplay.anchor_capture_triton(x.cuda(), src.cuda(), dst.cuda(), pool)
    assert torch.equal(pool.cpu(), want)


def test_ptx_for_tensorrt_launched_with_cupy_matches_reference():
    """The PTX the TensorRT plugin embeds (plugins/tensorrt.py), launched directly."""
    cupy = pytest.importorskip("cupy")
    from plugins.tensorrt import compile_ptx

    major, minor = torch.cuda.get_device_capability()
    H, K, V = 4, 64, 64
    kernel = compile_ptx("gated_delta_scan", "float32", arch=major * 10 + minor, heads=H,
                         k_dim=K, v_dim=V)
    cpu, dev = _scan_inputs([40, 9], H, K, V, "cuda")
    want_o, want_s = ref.gated_delta_scan_ref(*cpu, K ** -0.5)
    q, k, v, gate, beta, cu, h0 = dev
    o, ht = torch.empty_like(v), torch.empty_like(h0)
    raw = cupy.cuda.Module()  # cuModuleLoadData JIT-compiles PTX for this device
    raw.load(kernel.ptx.encode())
    fn = raw.get_function(kernel.name)
    args = [t.data_ptr() for t in (q, k, v, gate, beta, h0, cu, o, ht)]
    fn((V // 32, 2 * H, 1), (kernel.num_warps * 32, 1, 1),
       # Triton appends two scratch pointers (global and profile scratch) to every kernel.
       [cupy.uint64(a) for a in args] + [cupy.uint64(0)] * 2, shared_mem=kernel.shared_bytes)
    torch.cuda.synchronize()
    torch.testing.assert_close(o.cpu(), want_o, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(ht.cpu(), want_s, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "nemotron_h_moe", "qwen3_next_moe"])
def test_aot_engine_on_cuda_matches_eager(tmp_path, family):
    """MoE families: the `moe_experts` operator's one form (PyTorch ops) on CUDA tensors."""
    import sys

    sys.path[:0] = ["tests/model", "tests/engine"]
    from engine_helpers import family_checkpoint

    from backend.engine.compiled import CompiledExecutor
    from backend.engine.executor import TorchExecutor
    from backend.model import SeqInput, load_model
    from engine_build.aot import build_aot_engine

    family_checkpoint(tmp_path / "ckpt", family, seed=3)
    engine = build_aot_engine(tmp_path / "ckpt", tmp_path / "aot", device="cuda", progress=False)
    model = load_model(tmp_path / "ckpt", device="cuda")
    sizes = (16, 16, 4, 4, 32)
    eager, compiled = TorchExecutor(model, *sizes), CompiledExecutor(engine, *sizes)
    ids = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    table = torch.arange(4)
    for ex in (eager, compiled):
        ex.out = ex.forward([SeqInput(ids, 0, table, 0)], torch.tensor([3, 39]),
                            torch.tensor([0, 1]))
        ex.out2 = ex.forward([SeqInput([5], 40, table, 0)])
        ex.replay([1], [torch.tensor([0, 1])])
    torch.testing.assert_close(compiled.out, eager.out, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(compiled.out2, eager.out2, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(compiled.run_states.rec[0][1], eager.run_states.rec[0][1],
                               atol=1e-3, rtol=1e-3)
    assert plugins.triton_available()
