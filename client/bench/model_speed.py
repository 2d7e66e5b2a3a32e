"""Prefill and decode tokens/s of our model against transformers on the same weights (CPU).

    python -m client.bench.model_speed [--quick] [--compiled] [--family nemotron_h]

Writes client/bench/results/model_speed/summary.json with per-case numbers and
`prefill_speedup_vs_hf` / `decode_speedup_vs_hf` (the smallest speedup over all cases) of the
eager model; with --compiled also `compiled_prefill_speedup_vs_hf` /
`compiled_decode_speedup_vs_hf` of the AOT-compiled engine of each model. The sides take
turns within every repeat and each keeps its fastest time, so slow minutes on this shared
host land on all of them. `--family nemotron_h` times the Nemotron-H-architecture models of the
same sizes against transformers' NemotronHForCausalLM (results/model_speed_nemotron_h/).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backend.model import load_model
from backend.model.generate import PagedSession
from client.bench.common import write_summary
from engine_build.hf_export import save_hf_directory
from engine_build.train_tiny import FAMILIES, init_weights, tiny_config

RESULTS = Path(__file__).resolve().parent / "results" / "model_speed"


def build_checkpoints(root: Path, family: str = "qwen3_5") -> dict[str, Path]:
    from backend.model.hybrid import HybridForCausalLM

    configs = {"tiny": tiny_config(family=family),
               "medium-1024x12": tiny_config(hidden=1024, layers=12, family=family)}
    paths = {}
    for name, cfg in configs.items():
        model = HybridForCausalLM(cfg)
        init_weights(model, seed=0, dt_init="log-uniform" if cfg.is_nemotron_h else "reference")
        paths[name] = save_hf_directory(model, root / name)
    return paths


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours(path: Path, batch: int, prompt_len: int, decode_steps: int):
    """(prefill, decode) of our eager model: each call returns its seconds."""
    model = load_model(path)
    ids = torch.randint(0, 256, (batch, prompt_len)).tolist()

    @torch.inference_mode()
    def prefill():
        return _timed(lambda: PagedSession(model, batch, prompt_len + decode_steps).step(ids))

    @torch.inference_mode()
    def decode():
        session = PagedSession(model, batch, prompt_len + decode_steps)
        session.step(ids)
        return _timed(lambda: [session.step([[1]] * batch) for _ in range(decode_steps)])

    return prefill, decode


def transformers_hf(path: Path, batch: int, prompt_len: int, decode_steps: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (batch, prompt_len))

    @torch.inference_mode()
    def prefill():
        return _timed(lambda: model(ids, use_cache=True))

    @torch.inference_mode()
    def decode():
        cache = _cache_of(model(ids, use_cache=True))
        step = torch.ones(batch, 1, dtype=torch.long)

        def steps():
            nonlocal cache
            for _ in range(decode_steps):
                cache = _cache_of(model(step, past_key_values=cache, use_cache=True))

        return _timed(steps)

    return prefill, decode


def _cache_of(out):
    """The cache a transformers forward returned (Nemotron-H's outputs name it `cache`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def compiled(engine_dir: Path, batch: int, prompt_len: int, decode_steps: int):
    """The same prefill and decode steps through the AOT-compiled engine."""
    from backend.engine.compiled import CompiledExecutor
    from backend.model import SeqInput

    page = 64
    per = -(-(prompt_len + decode_steps) // page)
    ex = CompiledExecutor(engine_dir, batch * per + 1, page, batch, 1, 64)
    tables = [torch.arange(b * per, (b + 1) * per) for b in range(batch)]
    ids = torch.randint(0, 256, (batch, prompt_len)).tolist()

    def run_prefill():
        return ex.forward([SeqInput(ids[b], 0, tables[b], b) for b in range(batch)])

    def decode():
        run_prefill()

        def steps():
            for s in range(decode_steps):
                ex.forward([SeqInput([1], prompt_len + s, tables[b], b) for b in range(batch)])

        return _timed(steps)

    run_prefill()  # warm-up
    return (lambda: _timed(run_prefill)), decode


def best_interleaved(sides: dict[str, tuple], repeats: int) -> dict[str, tuple[float, float]]:
    """Fastest (prefill, decode) seconds of each side, the sides taking turns within every
    repeat (this host's noise drifts over minutes: timing one side after the other skewed
    the ratios by up to 30%). One untimed round first (warm-up)."""
    times = {name: ([], []) for name in sides}
    for r in range(repeats + 1):
        for name, (prefill, decode) in sides.items():
            p, d = prefill(), decode()
            if r:
                times[name][0].append(p)
                times[name][1].append(d)
    return {name: (min(p), min(d)) for name, (p, d) in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--compiled", action="store_true",
                   help="also time the AOT-compiled engine (engine_build/aot.py) of each model")
    p.add_argument("--family", choices=FAMILIES, default="qwen3_5")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    prompt_len, decode_steps, repeats = (256, 16, 4) if args.quick else (512, 32, 5)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_checkpoints(Path(tmp), args.family)
        engines = {}
        if args.compiled:
            from engine_build.aot import build_aot_engine

            engines = {n: build_aot_engine(p, Path(tmp) / f"{n}-aot") for n, p in paths.items()}
        jobs = [(n, b) for n in paths for b in (1, 8)]
        for name, batch in tqdm(jobs, desc="model_speed"):
            args_ = (batch, prompt_len, decode_steps)
            sides = {"ours": ours(paths[name], *args_), "hf": transformers_hf(paths[name], *args_)}
            if engines:
                sides["compiled"] = compiled(engines[name], *args_)
            best = best_interleaved(sides, repeats)
            (ours_p, ours_d), (hf_p, hf_d) = best["ours"], best["hf"]
            cases.append({
                "model": name, "batch": batch, "prompt_len": prompt_len,
                "prefill_tok_s": batch * prompt_len / ours_p,
                "hf_prefill_tok_s": batch * prompt_len / hf_p,
                "decode_tok_s": batch * decode_steps / ours_d,
                "hf_decode_tok_s": batch * decode_steps / hf_d,
                "prefill_speedup": hf_p / ours_p, "decode_speedup": hf_d / ours_d,
            })
            if engines:
                c_p, c_d = best["compiled"]
                cases[-1].update({
                    "compiled_prefill_tok_s": batch * prompt_len / c_p,
                    "compiled_decode_tok_s": batch * decode_steps / c_d,
                    "compiled_prefill_speedup": hf_p / c_p,
                    "compiled_decode_speedup": hf_d / c_d})
    summary = {
        "prefill_speedup_vs_hf": min(c["prefill_speedup"] for c in cases),
        "decode_speedup_vs_hf": min(c["decode_speedup"] for c in cases),
        **({"compiled_prefill_speedup_vs_hf": min(c["compiled_prefill_speedup"] for c in cases),
            "compiled_decode_speedup_vs_hf": min(c["compiled_decode_speedup"] for c in cases)}
           if args.compiled else {}),
        "cases": cases, "threads": torch.get_num_threads(), "repeats": repeats,
        "method": "fastest of the repeats; ours, transformers (and the compiled engine) take "
                  "turns within each repeat",
        "family": args.family,
        "date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU (no GPU)",
    }
    out = RESULTS if args.family == "qwen3_5" else RESULTS.with_name(f"model_speed_{args.family}")
    write_summary(out / "summary.json", summary, echo=False)
    for c in cases:
        print(f"{c['model']:>15} b={c['batch']}: prefill {c['prefill_tok_s']:8.0f} tok/s "
              f"({c['prefill_speedup']:.2f}x HF)  decode {c['decode_tok_s']:7.0f} tok/s "
              f"({c['decode_speedup']:.2f}x HF)")
    return summary


if __name__ == "__main__":
    main()
