"""Prefill and decode tokens/s of our model against transformers on the same weights (CPU).

    python -m client.bench.model_speed [--quick] [--compiled]

Writes client/bench/results/model_speed/summary.json with per-case numbers and
`prefill_speedup_vs_hf` / `decode_speedup_vs_hf` (the smallest speedup over all cases) of the
eager model; with --compiled also `compiled_prefill_speedup_vs_hf` /
`compiled_decode_speedup_vs_hf` of the AOT-compiled engine of each model.
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
from engine_build.train_tiny import init_weights, tiny_config

RESULTS = Path(__file__).resolve().parent / "results" / "model_speed"


def build_checkpoints(root: Path) -> dict[str, Path]:
    from backend.model.hybrid import HybridForCausalLM

    configs = {"tiny": tiny_config(), "medium-1024x12": tiny_config(hidden=1024, layers=12)}
    paths = {}
    for name, cfg in configs.items():
        model = HybridForCausalLM(cfg)
        init_weights(model, seed=0)
        paths[name] = save_hf_directory(model, root / name)
    return paths


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@torch.inference_mode()
def ours(path: Path, batch: int, prompt_len: int, decode_steps: int, repeats: int):
    model = load_model(path)
    ids = torch.randint(0, 256, (batch, prompt_len)).tolist()

    def prefill():
        return PagedSession(model, batch, prompt_len + decode_steps).step(ids)

    def decode():
        session = PagedSession(model, batch, prompt_len + decode_steps)
        session.step(ids)
        t = time.perf_counter()
        for _ in range(decode_steps):
            session.step([[1]] * batch)
        return time.perf_counter() - t

    return _best(prefill, repeats), min(decode() for _ in range(repeats))


@torch.inference_mode()
def transformers_hf(path: Path, batch: int, prompt_len: int, decode_steps: int, repeats: int):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (batch, prompt_len))

    def prefill():
        return model(ids, use_cache=True)

    def decode():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        step = torch.ones(batch, 1, dtype=torch.long)
        t = time.perf_counter()
        for _ in range(decode_steps):
            out = model(step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        return time.perf_counter() - t

    return _best(prefill, repeats), min(decode() for _ in range(repeats))


def compiled(path: Path, engine_dir: Path, batch: int, prompt_len: int, decode_steps: int,
             repeats: int) -> tuple[float, float]:
    """Seconds for the same prefill and decode steps through the AOT-compiled engine."""
    from backend.engine.compiled import CompiledExecutor
    from backend.model import SeqInput

    page = 64
    per = -(-(prompt_len + decode_steps) // page)
    ex = CompiledExecutor(engine_dir, batch * per + 1, page, batch, 1, 64)
    tables = [torch.arange(b * per, (b + 1) * per) for b in range(batch)]
    ids = torch.randint(0, 256, (batch, prompt_len)).tolist()

    def prefill():
        return ex.forward([SeqInput(ids[b], 0, tables[b], b) for b in range(batch)])

    def decode():
        prefill()
        t = time.perf_counter()
        for s in range(decode_steps):
            ex.forward([SeqInput([1], prompt_len + s, tables[b], b) for b in range(batch)])
        return time.perf_counter() - t

    prefill()  # warm-up
    return _best(prefill, repeats), min(decode() for _ in range(repeats))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--compiled", action="store_true",
                   help="also time the AOT-compiled engine (engine_build/aot.py) of each model")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    prompt_len, decode_steps, repeats = (256, 16, 2) if args.quick else (512, 32, 3)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_checkpoints(Path(tmp))
        engines = {}
        if args.compiled:
            from engine_build.aot import build_aot_engine

            engines = {n: build_aot_engine(p, Path(tmp) / f"{n}-aot") for n, p in paths.items()}
        jobs = [(n, b) for n in paths for b in (1, 8)]
        for name, batch in tqdm(jobs, desc="model_speed"):
            ours_p, ours_d = ours(paths[name], batch, prompt_len, decode_steps, repeats)
            hf_p, hf_d = transformers_hf(paths[name], batch, prompt_len, decode_steps, repeats)
            cases.append({
                "model": name, "batch": batch, "prompt_len": prompt_len,
                "prefill_tok_s": batch * prompt_len / ours_p,
                "hf_prefill_tok_s": batch * prompt_len / hf_p,
                "decode_tok_s": batch * decode_steps / ours_d,
                "hf_decode_tok_s": batch * decode_steps / hf_d,
                "prefill_speedup": hf_p / ours_p, "decode_speedup": hf_d / ours_d,
            })
            if engines:
                c_p, c_d = compiled(paths[name], engines[name], batch, prompt_len,
                                    decode_steps, repeats)
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
        "cases": cases, "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU (no GPU)",
    }
    write_summary(RESULTS / "summary.json", summary, echo=False)
    for c in cases:
        print(f"{c['model']:>15} b={c['batch']}: prefill {c['prefill_tok_s']:8.0f} tok/s "
              f"({c['prefill_speedup']:.2f}x HF)  decode {c['decode_tok_s']:7.0f} tok/s "
              f"({c['decode_speedup']:.2f}x HF)")
    return summary


if __name__ == "__main__":
    main()
