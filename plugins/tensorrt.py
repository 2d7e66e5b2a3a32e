"""The Triton kernels as TensorRT quickly-deployable plugins (QDP) with ahead-of-time PTX.

What runs everywhere (tested on the CPU): `compile_ptx` turns each kernel of
`plugins/triton_kernels.py` into PTX for an NVIDIA architecture with Triton's compiler (no GPU
is needed to generate PTX). That PTX is what the plugins embed in a TensorRT engine.

What needs TensorRT (NVIDIA's package index; not installable in this project's environment,
so this part has never run): `register_plugins` registers `suffixreplay::gated_delta_scan` and
`suffixreplay::causal_conv1d` with `tensorrt.plugin` (shape descriptors + `aot_impl` returning
the PTX and launch grid), and `build_tensorrt_engine` compiles the exported group-replay graphs
through Torch-TensorRT with those plugins. Anchor capture writes into an existing pool in
place, which a TensorRT plugin cannot alias; a TensorRT engine exposes the captured rows as an
output (a gather) and the runtime scatters them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def tensorrt_available() -> tuple[bool, str]:
    try:
        import tensorrt  # noqa: F401
        import tensorrt.plugin  # noqa: F401
    except ImportError as e:
        return False, f"cannot import tensorrt ({e})"
    except Exception as e:  # the PyPI stub raises while trying to reach NVIDIA's index
        return False, f"the tensorrt package is a stub or broken ({type(e).__name__}: {e})"
    return True, ""


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared_bytes: int
    arch: int


def _specs(dtype: str, heads: int, k_dim: int, v_dim: int, conv_width: int):
    """(kernel, signature, constexprs) per operator, in the TensorRT argument order."""
    from plugins import triton_kernels as tk

    t = _DTYPES[dtype]
    bk = 1 << (k_dim - 1).bit_length()
    bv = min(1 << (v_dim - 1).bit_length(), 32)
    scan_signature = {
        "q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": f"*{t}", "g_ptr": "*fp32",
        "beta_ptr": f"*{t}", "h0_ptr": "*fp32", "cu_ptr": "*i32", "o_ptr": f"*{t}",
        "ht_ptr": "*fp32", "H": "constexpr", "K": "constexpr", "V": "constexpr",
        "BK": "constexpr", "BV": "constexpr", "HAS_H0": "constexpr", "SCALE": "constexpr",
        "DELTA": "constexpr"}
    return {
        "gated_delta_scan": (
            tk.linear_scan_kernel, scan_signature,
            {"H": heads, "K": k_dim, "V": v_dim, "BK": bk, "BV": bv, "HAS_H0": True,
             "SCALE": k_dim ** -0.5, "DELTA": True},
        ),
        # Mamba2 (Nemotron-H): heads = Mamba heads, k_dim = d_state, v_dim = head dim; the
        # kernel reads no beta (its pointer is the gate's).
        "ssd_scan": (
            tk.linear_scan_kernel, scan_signature,
            {"H": heads, "K": k_dim, "V": v_dim, "BK": bk, "BV": bv, "HAS_H0": True,
             "SCALE": 1.0, "DELTA": False},
        ),
        "causal_conv1d": (
            tk.causal_conv1d_kernel,
            {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "s0_ptr": f"*{t}", "cu_ptr": "*i32",
             "C": "i32", "y_ptr": f"*{t}", "st_ptr": f"*{t}", "W": "constexpr",
             "BC": "constexpr", "HAS_S0": "constexpr", "SILU": "constexpr"},
            {"W": conv_width, "BC": 128, "HAS_S0": True, "SILU": True},
        ),
        "anchor_capture": (
            tk.anchor_capture_kernel,
            {"h_ptr": f"*{t}", "src_ptr": "*i64", "dst_ptr": "*i64", "D": "i32",
             "pool_ptr": f"*{t}", "BD": "constexpr"},
            {"BD": 1024},
        ),
    }


def compile_ptx(op: str, dtype: str = "bfloat16", arch: int = 90, heads: int = 32,
                k_dim: int = 128, v_dim: int = 128, conv_width: int = 4) -> CompiledKernel:
    """PTX of one operator's Triton kernel for sm_<arch> (the defaults: Qwen3.5-4B shapes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    specs = _specs(dtype, heads, k_dim, v_dim, conv_width)
    if op not in specs:
        raise ValueError(f"unknown operator {op!r}; expected one of {sorted(specs)}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter patches triton.language process-wide: compile in a clean process.
        return _compile_in_subprocess(op, dtype, arch, heads, k_dim, v_dim, conv_width)
    fn, signature, constexprs = specs[op]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    meta = kernel.metadata
    return CompiledKernel(meta.name, kernel.asm["ptx"], meta.num_warps, meta.shared, arch)


def _compile_in_subprocess(*args) -> CompiledKernel:
    code = ("import json, sys; from plugins.tensorrt import compile_ptx; "
            "k = compile_ptx(*json.loads(sys.argv[1])); "
            "print(json.dumps([k.name, k.ptx, k.num_warps, k.shared_bytes, k.arch]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(list(args))], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"PTX compilation failed: {out.stderr[-2000:]}")
    return CompiledKernel(*json.loads(out.stdout.strip().splitlines()[-1]))


def register_plugins(dtype: str = "bfloat16", arch: int = 90) -> list[str]:
    """Registers the QDP plugins with TensorRT (needs `tensorrt`); returns their ids."""
    ok, why = tensorrt_available()
    if not ok:
        raise RuntimeError(f"TensorRT is not available: {why}")
    import tensorrt.plugin as trtp

    @trtp.register("suffixreplay::gated_delta_scan")
    def _scan_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc,
                   g: trtp.TensorDesc, beta: trtp.TensorDesc, h0: trtp.TensorDesc,
                   cu: trtp.TensorDesc) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return v.like(), h0.like()

    @trtp.aot_impl("suffixreplay::gated_delta_scan")
    def _scan_aot(q, k, v, g, beta, h0, cu, outputs, tactic):
        heads, k_dim, v_dim = q.shape_expr[1], q.shape_expr[2], v.shape_expr[2]
        compiled = compile_ptx("gated_delta_scan", dtype, arch, int(heads), int(k_dim),
                               int(v_dim))
        bv = min(1 << (int(v_dim) - 1).bit_length(), 32)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = (int(v_dim) + bv - 1) // bv
        launch.grid_y = (cu.shape_expr[0] - 1) * heads
        launch.block_x = compiled.num_warps * 32
        launch.shared_mem = compiled.shared_bytes
        return compiled.name, compiled.ptx, launch, trtp.SymIntExprs(0)

    @trtp.register("suffixreplay::causal_conv1d")
    def _conv_desc(x: trtp.TensorDesc, w: trtp.TensorDesc, s0: trtp.TensorDesc,
                   cu: trtp.TensorDesc) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return x.like(), s0.like()

    @trtp.aot_impl("suffixreplay::causal_conv1d")
    def _conv_aot(x, w, s0, cu, outputs, tactic):
        channels, width = w.shape_expr[0], w.shape_expr[1]
        compiled = compile_ptx("causal_conv1d", dtype, arch, conv_width=int(width))
        launch = trtp.KernelLaunchParams()
        launch.grid_x = cu.shape_expr[0] - 1
        launch.grid_y = (channels + 127) // 128
        launch.block_x = compiled.num_warps * 32
        launch.shared_mem = compiled.shared_bytes
        extra = trtp.SymIntExprs(1)
        extra[0] = trtp.SymInt32(channels)
        return compiled.name, compiled.ptx, launch, extra

    return ["suffixreplay::gated_delta_scan", "suffixreplay::causal_conv1d"]


def build_tensorrt_engine(model_dir: str | Path, out_dir: str | Path,
                          dtype: str = "bfloat16") -> Path:
    """Group-replay engines through Torch-TensorRT with the plugins (needs TensorRT + CUDA)."""
    import torch

    ok, why = tensorrt_available()
    if not ok:
        raise RuntimeError(f"TensorRT is not available: {why}")
    if not torch.cuda.is_available():
        raise RuntimeError("building TensorRT engines needs a CUDA GPU")
    import torch_tensorrt
    from torch_tensorrt.dynamo.conversion.plugins import generate_plugin_converter

    from backend.engine.config import DTYPES
    from backend.model import load_model
    from engine_build.aot import export_replay

    register_plugins(dtype)
    for op in ("gated_delta_scan", "causal_conv1d"):
        generate_plugin_converter(f"suffixreplay::{op}", supports_dynamic_shapes=True)
    model = load_model(model_dir, dtype=DTYPES[dtype], device="cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for g in range(model.config.num_groups):
        program = export_replay(model, g)
        trt_module = torch_tensorrt.dynamo.compile(program, enabled_precisions={DTYPES[dtype]})
        torch_tensorrt.save(trt_module, str(out / f"replay_{g}.ep"))
    return out
