"""Ahead-of-time engines: `torch.export` + AOTInductor `.pt2` packages with our operators.

An engine directory holds
- `prefill.pt2`: one step over packed tokens with dynamic batch, token and context counts
  (query length >= 2); CPU engines' prefill also saves one state per sequence mid-step
  (`engine.json` "step_snapshots");
- `decode.pt2`: the same step with one token per sequence;
- `replay_<g>.pt2`: group g's linear layers from zero state over packed anchors;
- `engine.json` (written last): format version, device, dtype, torch version, the source
  checkpoint's path and signature (`checkpoint_signature`: an engine loads only beside it),
  each package's digest (`package_digest`: a package changed since does not load);
- `config.json`: the model configuration (buffer shapes for the executor).
Page pools, state slots and anchor pools are inputs mutated in place, so their sizes are free
at run time (the serving configuration chooses them). `backend.engine.compiled.CompiledExecutor`
runs an engine; only `plugins` (the operators) is needed beside it, not the model code.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from torch.export import Dim
from tqdm import tqdm

from backend.engine.compiled import ENGINE_FORMAT, checkpoint_signature, package_digest
from backend.engine.config import DTYPES
from backend.model import load_model
from backend.model.hybrid import HybridForCausalLM
from backend.model.packed import ReplayGraph, StepGraph

MAX_TOKENS = 1 << 16


def _buffers(model: HybridForCausalLM, kv_rows: int, slots: int, anchor_rows: int):
    cfg, dtype, device = model.config, model.dtype, model.device
    A, L, G = len(cfg.attention_layer_ids), len(cfg.linear_layer_ids), cfg.num_groups
    kv_shape = (kv_rows, cfg.num_key_value_heads, cfg.head_dim)
    anchors = tuple(torch.zeros(anchor_rows, cfg.hidden_size, dtype=dtype, device=device)
                    for _ in range(G))
    k = tuple(torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(A))
    v = tuple(torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(A))
    conv = tuple(torch.zeros(slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype,
                             device=device) for _ in range(L))
    rec = tuple(torch.zeros(slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim, device=device) for _ in range(L))
    return anchors, k, v, conv, rec


def step_example(model: HybridForCausalLM, decode: bool, snapshots: bool = False):
    """Example inputs for StepGraph (sizes all >= 2 and distinct, so no size specialises)."""
    device = model.device
    vocab = model.config.vocab_size
    lens = [1, 1, 1] if decode else [5, 2]
    B, T, N = len(lens), max(lens), sum(lens)
    ctx = 11
    kv_rows, slots, anchor_rows = 64, 6, 13
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    pad_index = torch.cat([torch.arange(n) + b * T for b, n in enumerate(lens)]).to(device)
    positions = torch.cat([torch.arange(n) + 3 for n in lens]).to(device)
    ids = torch.randint(0, vocab, (N,), device=device)
    write_slots = torch.arange(N, device=device) + 20
    read_slots = torch.randint(0, kv_rows, (B, ctx), device=device)
    mask = torch.ones(B, 1, T, ctx, dtype=torch.bool, device=device)
    state_slots = torch.tensor(list(range(1, B + 1)), device=device)
    fresh = torch.zeros(B, dtype=torch.bool, device=device)
    cap_src = torch.tensor([0, 1, N - 1][: 3], device=device)
    cap_dst = torch.tensor([2, 3, 4], device=device)
    bufs = _buffers(model, kv_rows, slots, anchor_rows)
    example = (ids, positions, cu, state_slots, fresh, write_slots, pad_index, read_slots,
               mask, cap_src, cap_dst, *bufs)
    if snapshots:  # no snapshot in the example (offsets 0, the scratch slot 6)
        saved = _buffers(model, kv_rows, 7, anchor_rows)[3:]
        example += (torch.zeros(B, dtype=torch.long, device=device),
                    torch.full((B,), 6, dtype=torch.long, device=device), *saved)
    return example


def step_dynamic_shapes(model: HybridForCausalLM, decode: bool, snapshots: bool = False):
    cfg = model.config
    seqs = Dim("seqs", min=1, max=4096)
    tokens = seqs if decode else Dim("tokens", min=1, max=MAX_TOKENS)
    qlen = None if decode else Dim("qlen", min=2, max=MAX_TOKENS)
    ctx = Dim("ctx", min=1, max=MAX_TOKENS)
    caps = Dim("caps", min=1, max=MAX_TOKENS)
    kv_rows, slots = Dim("kvrows", min=1), Dim("slots", min=1)
    arows = Dim("arows", min=1)
    A, L, G = len(cfg.attention_layer_ids), len(cfg.linear_layer_ids), cfg.num_groups
    mask = {0: seqs, 3: ctx} if decode else {0: seqs, 2: qlen, 3: ctx}
    shapes = ({0: tokens}, {0: tokens}, {0: seqs + 1}, {0: seqs}, {0: seqs}, {0: tokens},
              {0: tokens}, {0: seqs, 1: ctx}, mask, {0: caps}, {0: caps},
              tuple({0: arows} for _ in range(G)), tuple({0: kv_rows} for _ in range(A)),
              tuple({0: kv_rows} for _ in range(A)), tuple({0: slots} for _ in range(L)),
              tuple({0: slots} for _ in range(L)))
    if snapshots:
        saved = Dim("saved", min=1)
        shapes += ({0: seqs}, {0: seqs}, tuple({0: saved} for _ in range(L)),
                   tuple({0: saved} for _ in range(L)))
    return shapes


def replay_example(model: HybridForCausalLM):
    D = model.config.hidden_size
    hidden = torch.randn(7, D, dtype=model.dtype, device=model.device)
    return hidden, torch.tensor([0, 4, 7], device=model.device)


def export_step(model: HybridForCausalLM, decode: bool, snapshots: bool = False):
    graph = StepGraph(model, decode=decode, snapshots=snapshots).eval()
    ex = step_example(model, decode, snapshots)
    with torch.no_grad():
        return torch.export.export(graph, ex, dynamic_shapes=step_dynamic_shapes(
            model, decode, snapshots))


def export_replay(model: HybridForCausalLM, group: int):
    graph = ReplayGraph(model, group).eval()
    tokens, seqs = Dim("tokens", min=1, max=MAX_TOKENS), Dim("seqs", min=1, max=4096)
    with torch.no_grad():
        return torch.export.export(graph, replay_example(model),
                                   dynamic_shapes=({0: tokens}, {0: seqs + 1}))


def build_aot_engine(model_dir: str | Path, out_dir: str | Path, device: str = "cpu",
                     dtype: str = "float32", progress: bool = True,
                     inductor_configs: dict | None = None) -> Path:
    """Exports and compiles every graph of `model_dir` into `out_dir`; returns out_dir."""
    import plugins  # noqa: F401  (registers the operators the graphs call)

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but CUDA is not available here")
    model = load_model(model_dir, dtype=DTYPES[dtype], device=device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # engine.json is written last: until then the folder is no engine (a rebuild that stops
    # part way leaves new packages beside old ones, which must not load as one)
    (out / "engine.json").unlink(missing_ok=True)
    # Mid-step snapshots through the CPU scan operator (CUDA engines end a step instead).
    snapshots = device == "cpu"
    jobs = [("prefill", lambda: export_step(model, decode=False, snapshots=snapshots)),
            ("decode", lambda: export_step(model, decode=True))]
    jobs += [(f"replay_{g}", lambda g=g: export_replay(model, g))
             for g in range(model.config.num_groups)]
    if inductor_configs is None and device == "cpu":
        # Weights become constants that Inductor pre-packs for oneDNN: batched decode ~1.2x.
        inductor_configs = {"freezing": True}
    packages, timings = {}, {}
    bar = tqdm(jobs, desc="aot compile", unit="graph", disable=not progress)
    for name, export in bar:
        bar.set_postfix(graph=name)
        t0 = time.time()
        program = export()
        path = out / f"{name}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=inductor_configs)
        packages[name] = path.name
        timings[name] = round(time.time() - t0, 1)
    shutil.copy(Path(model_dir) / "config.json", out / "config.json")
    meta = {"format": ENGINE_FORMAT, "backend": "aot", "device": device, "dtype": dtype,
            "torch": torch.__version__, "num_groups": model.config.num_groups,
            "packages": packages, "compile_seconds": timings, "step_snapshots": snapshots,
            "package_digests": {name: package_digest(out / file)
                                for name, file in packages.items()},
            "inductor_configs": inductor_configs or {},
            "source_model": str(Path(model_dir).resolve()),
            "source_signature": checkpoint_signature(model_dir)}
    (out / "engine.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
