"""Eager against AOT-compiled execution: prefill, decode and replay tokens per second (CPU).

    python -m client.bench.engine_speed [--quick] [--model DIR] [--engine DIR]

Both executors get the same buffers and the same step inputs (the engine's own planner);
`--engine` reuses a built engine directory, otherwise one is compiled into a temporary folder
first (engine_build/aot.py). Writes client/bench/results/engine_speed/summary.json with
per-case numbers and `compiled_prefill_speedup`, `compiled_decode_speedup`,
`compiled_replay_speedup` (geometric means over the cases).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backend.engine.compiled import CompiledExecutor
from backend.engine.executor import TorchExecutor
from backend.model import SeqInput, load_model
from client.bench.common import RESULTS_ROOT, model_parser, write_summary

RESULTS = RESULTS_ROOT / "engine_speed"
PAGE = 64


def _executors(model, engine_dir: Path, max_tokens: int, batch: int):
    pages = batch * (-(-max_tokens // PAGE)) + 1
    sizes = (pages, PAGE, batch, 1, 4096)
    return {"eager": TorchExecutor(model, *sizes), "compiled": CompiledExecutor(engine_dir, *sizes)}


def _tables(batch: int, max_tokens: int) -> list[torch.Tensor]:
    per = -(-max_tokens // PAGE)
    return [torch.arange(b * per, (b + 1) * per) for b in range(batch)]


def _best(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def prefill_case(exs, batch: int, length: int, repeats: int) -> dict:
    tables = _tables(batch, length)
    ids = torch.randint(0, 256, (batch, length)).tolist()
    seqs = [SeqInput(ids[b], 0, tables[b], b) for b in range(batch)]
    out = {}
    for name, ex in exs.items():
        ex.forward(seqs)  # warm-up
        out[name] = batch * length / _best(lambda ex=ex: ex.forward(seqs), repeats)
    return out


@torch.inference_mode()
def decode_case(exs, batch: int, context: int, steps: int, repeats: int) -> dict:
    tables = _tables(batch, context + steps)
    ids = torch.randint(0, 256, (batch, context)).tolist()
    out = {}
    for name, ex in exs.items():
        def run(ex=ex):
            for s in range(steps):
                ex.forward([SeqInput([1], context + s, tables[b], b) for b in range(batch)])

        ex.forward([SeqInput(ids[b], 0, tables[b], b) for b in range(batch)])
        run()  # warm-up
        out[name] = batch * steps / _best(run, repeats)
    return out


@torch.inference_mode()
def replay_case(exs, batch: int, anchors: int, repeats: int) -> dict:
    rows = [torch.arange(b * anchors, (b + 1) * anchors) for b in range(batch)]
    out = {}
    for name, ex in exs.items():
        ex.anchors.copy_(torch.randn_like(ex.anchors.float()).to(ex.anchors.dtype))
        ex.replay(list(range(batch)), rows)  # warm-up
        out[name] = batch * anchors / _best(lambda ex=ex: ex.replay(list(range(batch)), rows),
                                            repeats)
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def run(model_dir: Path, engine_dir: Path | None, quick: bool) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = load_model(model_dir)
    tmp = None
    if engine_dir is None:
        from engine_build.aot import build_aot_engine

        tmp = tempfile.TemporaryDirectory()
        engine_dir = build_aot_engine(model_dir, Path(tmp.name) / "engine")
    repeats = 2 if quick else 4
    cases = {"prefill": [(1, 512), (4, 256)] if quick else [(1, 512), (1, 2048), (4, 256)],
             "decode": [(1, 256), (8, 256)] if quick else [(1, 256), (4, 256), (16, 256)],
             "replay": [(8, 16)] if quick else [(1, 64), (8, 16), (32, 16)]}
    results: dict[str, list[dict]] = {k: [] for k in cases}
    jobs = [(kind, case) for kind, cs in cases.items() for case in cs]
    for kind, case in tqdm(jobs, desc="engine speed"):
        if kind == "prefill":
            exs = _executors(model, engine_dir, case[1], case[0])
            tps = prefill_case(exs, *case, repeats)
            row = {"batch": case[0], "tokens": case[1]}
        elif kind == "decode":
            steps = 16 if quick else 32
            exs = _executors(model, engine_dir, case[1] + steps, case[0])
            tps = decode_case(exs, case[0], case[1], steps, repeats)
            row = {"batch": case[0], "context": case[1], "steps": steps}
        else:
            exs = _executors(model, engine_dir, PAGE, case[0])
            tps = replay_case(exs, *case, repeats)
            row = {"batch": case[0], "anchors_per_group": case[1]}
        row.update({f"{k}_tokens_per_s": round(v, 1) for k, v in tps.items()},
                   speedup=round(tps["compiled"] / tps["eager"], 3))
        results[kind].append(row)
    summary = {
        "model": str(model_dir), "machine": "2-core CPU, no GPU", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "quick": quick, "results": results,
        "compiled_prefill_speedup": round(_geomean([r["speedup"] for r in results["prefill"]]), 3),
        "compiled_decode_speedup": round(_geomean([r["speedup"] for r in results["decode"]]), 3),
        "compiled_replay_speedup": round(_geomean([r["speedup"] for r in results["replay"]]), 3),
    }
    if tmp is not None:
        tmp.cleanup()
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = model_parser(__doc__)
    p.add_argument("--engine", default=None, help="a built engine directory to reuse")
    p.add_argument("--out", default=str(RESULTS / "summary.json"))
    args = p.parse_args(argv)
    summary = run(Path(args.model), Path(args.engine) if args.engine else None, args.quick)
    write_summary(Path(args.out), summary)
    return summary


if __name__ == "__main__":
    main()
