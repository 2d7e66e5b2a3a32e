"""Beam search: what sharing the beams' pages through the prefix store saves.

Engine runs (in-process, the default model): one search at a time of width W over a
`--prompt-tokens` prompt, generating `--max-tokens` tokens (no end id: every search runs to
its length), under two systems:
- `shared` (cache policy suffixreplay): beams lock the store's pages of their common prefix
  (the prompt, and the pages they had in common when one forked from another); a fork copies
  only its parent's last, partial page;
- `copied` (cache policy none): nothing is shared, so a fork copies every page of its parent,
  as an engine without a shared page pool must.
Width 1 is greedy decoding, the baseline of time. Per (width, system): the peak device KV
pages the search holds (its beams' private pages plus the store's pages they lock), pages
copied by forks, time per search and generated tokens per second over all beams; medians of
`--repeats` runs in rotating order.

    python -m client.bench.beam [--widths 1 2 4 8] [--max-tokens 64] [--repeats 3]
Writes client/bench/results/beam/summary.json and beam.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from backend.cache.config import CacheConfig
from backend.engine import Engine, EngineConfig, Request, SamplingParams
from client.bench.common import DEFAULT_MODEL, bench_main, config_of, machine, pyplot, save_figure
from client.bench.workloads import TextSource

RESULTS = Path(__file__).resolve().parent / "results" / "beam"
SYSTEMS = {"shared": "suffixreplay", "copied": "none"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def pages_held(engine: Engine) -> int:
    """Device KV pages running requests hold: private ones and locked store pages."""
    store = engine.store
    return len(store.kv.ids) + store.evictor.num_locked_device


def search(engine: Engine, prompt: list[int], width: int,
           args: argparse.Namespace) -> dict[str, float]:
    """One search (width 1: greedy) from a cold prefix, stepped here to watch its pages."""
    salt = uuid.uuid4().hex
    params = SamplingParams(max_tokens=args.max_tokens, end_id=-1, beam_width=width,
                            top_k=1 if width == 1 else 0)
    done = []
    before = engine.stats()
    start = time.perf_counter()
    engine.submit(Request(salt, prompt, params, cache_salt=salt, on_output=lambda o: (
        done.append(o) if o.finished else None)))
    peak = 0
    while not done:
        engine.step()
        peak = max(peak, pages_held(engine))
    seconds = time.perf_counter() - start
    after = engine.stats()
    return {"peak_pages": peak, "seconds": seconds,
            "tokens_per_s": width * args.max_tokens / seconds,
            "forks": after["beam_forks"] - before["beam_forks"],
            "pages_copied": after["beam_pages_copied"] - before["beam_pages_copied"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    pages = -(-(args.prompt_tokens + args.max_tokens) // 64) * max(args.widths) + 64
    engines = {name: Engine.from_model_dir(args.model, EngineConfig(
        max_num_seqs=max(max(args.widths), 2),
        cache=CacheConfig(policy=policy, num_kv_pages=pages)))
        for name, policy in SYSTEMS.items()}
    prompt = TextSource(args.seed).take(args.prompt_tokens)
    names = list(SYSTEMS)
    results: dict[str, dict[str, dict[str, float]]] = {}
    bar = tqdm(total=len(args.widths) * args.repeats * len(names), desc="beam searches")
    for width in args.widths:
        for engine in engines.values():  # warm
            search(engine, prompt, width, args)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs[name].append(search(engines[name], prompt, width, args))
                bar.update()
        results[f"w{width}"] = {
            name: {k: round(statistics.median(x[k] for x in rows), 3) for k in rows[0]}
            for name, rows in runs.items()}
    bar.close()
    summary = {
        "results": results,
        "peak_pages_copied_over_shared": {
            case: round(row["copied"]["peak_pages"] / row["shared"]["peak_pages"], 2)
            for case, row in results.items()},
        "config": config_of(args),
        "machine": machine(),
    }
    plot(results, args.out.with_name("beam.png"))
    return summary


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    plt = pyplot()

    widths = [int(case[1:]) for case in results]
    fig, (pages, speed) = plt.subplots(1, 2, figsize=(10, 4))
    for name in SYSTEMS:
        pages.plot(widths, [results[f"w{w}"][name]["peak_pages"] for w in widths], "o-",
                   label=name)
        speed.plot(widths, [results[f"w{w}"][name]["seconds"] * 1000 for w in widths], "o-",
                   label=name)
    pages.set_xlabel("beam width")
    pages.set_ylabel("peak device KV pages held")
    speed.set_xlabel("beam width")
    speed.set_ylabel("ms per search")
    for ax in (pages, speed):
        ax.set_xticks(widths)
        ax.legend()
    fig.suptitle("Beam search: beams sharing the store's pages vs copying them (default "
                 "model, CPU)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
