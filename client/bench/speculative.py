"""Speculative decoding (n-gram prompt lookup, suffix decoding) against a token a step, on the
same prompts.

Engine runs (in-process, the default model, trained on Python source): B requests at once,
each generating exactly N tokens after a 400-token prompt, on three workloads:
- `code`: continue a stretch of standard-library source, greedy (the model's own repetitions
  and the file's identifiers are what drafts find);
- `quote`: the same source, then a comment asking for it again and its first line: the
  output copies the prompt, as RAG answers that quote their documents and code edits do;
- `sampled`: `code` at temperature 0.8 (a draft token is kept with its probability only);
- `repeat`: `code` asked again in one cache namespace (each run's prompts start with a new
  first line, so the prefix cache serves none of them): what an agent loop, a retry or a
  recurring question does; earlier runs' outputs are what suffix decoding drafts from.
Systems: `off` (speculative_method none), `adaptive` (ngram, the default policy: a step's
drafts cut to the length its measured step times make worth it), `whole` (ngram, every
proposal verified whole: speculative_adaptive off) and `suffix` (suffix decoding, the
default policy: the sequence's own tokens and its namespace's earlier outputs). Each
(workload, batch) runs its systems `--repeats` times in rotating order; medians are
reported, with decode-phase output tokens per second (after each request's first token),
steps, drafts proposed and kept.

    python -m client.bench.speculative [--batches 1 8] [--max-tokens 128] [--repeats 5]
Writes client/bench/results/speculative/summary.json and speculative.png.
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from backend.engine import Engine, EngineConfig, Request, SamplingParams
from client.bench.common import (
    DEFAULT_MODEL,
    OutputTimes,
    bench_main,
    config_of,
    machine,
    pyplot,
    save_figure,
)
from client.bench.workloads import TextSource

RESULTS = Path(__file__).resolve().parent / "results" / "speculative"
SYSTEMS = {
    "off": dict(speculative_method="none"),
    "adaptive": dict(speculative_method="ngram"),
    "whole": dict(speculative_method="ngram", speculative_adaptive=False),
    "suffix": dict(speculative_method="suffix"),
}
WORKLOADS = ("code", "quote", "sampled", "repeat")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def prompts(workload: str, n: int, args: argparse.Namespace) -> list[list[int]]:
    """n prompts of the workload (byte ids), the same for every system."""
    src = TextSource(args.seed)
    out = []
    for _ in range(n):
        text = src.take(args.prompt_tokens)
        if workload == "quote":
            first = bytes(text).split(b"\n", 1)[0] + b"\n"
            text = text + list(b"\n\n# The same code again, unchanged:\n" + first)
        out.append(text)
    return out


def engine_run(engine: Engine, batch: list[list[int]], workload: str,
               args: argparse.Namespace) -> dict[str, float]:
    """The batch at once from a cold prefix: decode-phase output tokens per second, the
    engine steps and the drafts proposed and kept."""
    salt = uuid.uuid4().hex
    if workload == "repeat":  # one namespace, prompts that miss the prefix cache
        batch = [list(f"# run {salt}\n".encode()) + prompt for prompt in batch]
        salt = "repeat"
    times = OutputTimes()
    greedy = workload != "sampled"
    before = engine.stats()
    for i, prompt in enumerate(batch):
        engine.submit(Request(f"{salt}-{uuid.uuid4().hex}", prompt, SamplingParams(
            max_tokens=args.max_tokens, min_tokens=args.max_tokens, top_k=1 if greedy else 0,
            temperature=1.0 if greedy else 0.8, seed=i), cache_salt=salt,
            on_output=times.on_output))
    while len(times.done) < len(batch):
        engine.step()
    after = engine.stats()
    return {"decode_tokens_per_s": times.decode_tokens_per_s(),
            "steps": after["steps"] - before["steps"],
            "drafted": after["spec_draft_tokens"] - before["spec_draft_tokens"],
            "kept": after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
            "corpus_drafts": after["spec_corpus_drafts"] - before["spec_corpus_drafts"],
            "output_tokens": sum(times.counts.values())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    engines = {name: Engine.from_model_dir(args.model, EngineConfig(**options))
               for name, options in SYSTEMS.items()}
    names = list(SYSTEMS)
    results: dict[str, dict[str, dict[str, float]]] = {}
    cases = [(w, b) for w in WORKLOADS for b in args.batches]
    bar = tqdm(total=len(cases) * args.repeats * len(names), desc="speculative runs")
    for workload, batch in cases:
        batch_prompts = prompts(workload, batch, args)
        for engine in engines.values():  # warm: kernels, the draft policy's first steps
            engine_run(engine, batch_prompts, workload, args)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs[name].append(engine_run(engines[name], batch_prompts, workload, args))
                bar.update()
        row = {}
        for name, rows in runs.items():
            med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
            med["decode_tokens_per_s"] = round(med["decode_tokens_per_s"], 1)
            med["kept_fraction"] = round(med["kept"] / med["drafted"], 3) if med["drafted"] \
                else 0.0
            med["tokens_per_step"] = round(med["output_tokens"] / med["steps"], 2)
            row[name] = med
        for name in names[1:]:
            row[name]["speedup"] = round(row[name]["decode_tokens_per_s"]
                                         / row["off"]["decode_tokens_per_s"], 3)
        results[f"{workload}_b{batch}"] = row
    bar.close()
    summary = {
        "results": results,
        "speedup": {case: {n: row[n]["speedup"] for n in names[1:]}
                    for case, row in results.items()},
        "config": config_of(args),
        "machine": machine(),
    }
    plot(summary["speedup"], args.out.with_name("speculative.png"))
    return summary


def plot(speedup: dict[str, dict[str, float]], path: Path) -> None:
    plt = pyplot()

    cases = list(speedup)
    systems = list(next(iter(speedup.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(systems)
    for i, name in enumerate(systems):
        ax.bar([c + i * width for c in range(len(cases))], [speedup[c][name] for c in cases],
               width, label=name if name == "suffix" else f"ngram, {name}")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks([c + width * (len(systems) - 1) / 2 for c in range(len(cases))], cases)
    ax.set_ylabel("decode tokens/s vs a token a step")
    ax.set_title("Speculative decoding (prompt lookup, suffix), default model, CPU")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
