"""An agent's calls between one-off prompts, under a prefix cache smaller than both: each
round sends one call [system prompt : its own question], then `--one-offs` unrelated prompts
as long as the system prompt (retrieved documents, other tenants). Three servers of one
configuration (`max_cached_pages` idle pages at most), one per way of sending the calls:

- `lru`: plain calls; the one-offs push the system prompt out between calls;
- `retain`: the system prompt's token range at retention priority 100
  (`retention_token_range_*`, TensorRT-LLM's KvCacheRetentionConfig);
- `session`: the calls carry a `session_id` (the server's `session_priority`, 50).

Rounds go to the three servers in turn (each request to every server before the next goes
to any), so the host's noise lands on all alike. Reported per system: the calls' and the
one-offs' time to first token (mean, median, P95) and the share of the calls' prompt tokens
served from the cache.

    python -m client.bench.retention [--system-tokens 1024] [--rounds 8] [--one-offs 3]
Writes client/bench/results/retention/summary.json and retention.png.
"""

from __future__ import annotations

import argparse
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm import tqdm

from client.bench.common import (
    bench_main,
    config_of,
    machine,
    pyplot,
    save_figure,
    ttft_stats,
)
from client.bench.overhead import prompt_of
from client.bench.serving import served_repository
from client.generate import GenerateParams, stream_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "retention"
SYSTEMS = ("lru", "retain", "session")
PAGE = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--one-offs", type=int, default=3, help="unrelated prompts between calls")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-cached-pages", type=int, default=24,
                   help="idle device pages the cache keeps (the system prompt's and one "
                        "one-off's do not fit together)")
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def send(url: str, params: GenerateParams) -> dict[str, float]:
    """Time to first token (s) and cached prompt tokens of one streamed request."""
    first, counts = None, {}
    for chunk in stream_grpc(url, params):
        if first is None and chunk.counts.get("num_output_tokens"):
            first = chunk.elapsed_s
        counts = chunk.counts or counts
    return {"ttft_s": first or 0.0, "cached": counts.get("cached_tokens", 0),
            "prompt": counts.get("num_input_tokens", 0)}


def call_params(system: str, question: str, how: str, session: str,
                args: argparse.Namespace) -> GenerateParams:
    extra: dict[str, Any] = {}
    if how == "retain":
        extra = {"retention_ranges": ((0, args.system_tokens, 100, -1),)}
    elif how == "session":
        extra = {"session_id": session}
    return GenerateParams(system + question, max_tokens=args.max_tokens, top_k=1, **extra)


def run(args: argparse.Namespace) -> dict[str, Any]:
    system = prompt_of(args.system_tokens, -7)
    session = uuid.uuid4().hex
    runs: dict[str, dict[str, list]] = {s: {"call": [], "one_off": []} for s in SYSTEMS}
    params = {"max_cached_pages": str(args.max_cached_pages)}
    with ExitStack() as stack:
        urls = {s: stack.enter_context(served_repository(params)).urls.grpc for s in SYSTEMS}
        for url in urls.values():  # warm-up: lazy initialisation, not in the cache's way
            send(url, GenerateParams(prompt_of(64, -1), max_tokens=2, top_k=1))
        total = args.rounds * (1 + args.one_offs)
        with tqdm(total=total * len(SYSTEMS), desc="retention", unit="req") as bar:
            for r in range(args.rounds):
                question = " " + prompt_of(args.question_tokens, 1000 + r)
                requests = [("call", how, call_params(system, question, how, session, args))
                            for how in SYSTEMS]
                for k in range(args.one_offs):
                    text = prompt_of(args.system_tokens, 10_000 + r * 100 + k)
                    one_off = GenerateParams(text, max_tokens=args.max_tokens, top_k=1)
                    requests += [("one_off", how, one_off) for how in SYSTEMS]
                for kind, how, p in requests:
                    runs[how][kind].append(send(urls[how], p))
                    bar.update()
    return summarize(args, runs)


def summarize(args: argparse.Namespace, runs: dict) -> dict[str, Any]:
    # The first call of each system is cold (nothing cached yet): left out of its stats.
    results = {how: {"calls": ttft_stats(r["call"][1:]), "one_offs": ttft_stats(r["one_off"])}
               for how, r in runs.items()}
    lru = results["lru"]["calls"]["ttft_mean_ms"]
    summary = {
        "results": results,
        "call_ttft_speedup_vs_lru": {
            how: round(lru / results[how]["calls"]["ttft_mean_ms"], 2)
            for how in SYSTEMS if how != "lru"},
        "note": "calls: the agent's requests after its first (cold) one; one_offs: the "
                "unrelated prompts between them; TTFT from when each request was sent, "
                "one request at a time; cached_fraction: prompt tokens served from the cache",
        "config": config_of(args),
        "machine": machine(),
    }
    plot(results, args.out.with_name("retention.png"))
    return summary


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(SYSTEMS))
    for offset, kind in ((-0.2, "calls"), (0.2, "one_offs")):
        means = [results[s][kind]["ttft_mean_ms"] for s in SYSTEMS]
        bars = ax.bar([i + offset for i in x], means, width=0.4, label=kind.replace("_", "-"))
        for bar, s in zip(bars, SYSTEMS):
            if kind == "calls":
                ax.annotate(f"{results[s]['calls']['cached_fraction']:.0%} cached",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(SYSTEMS)
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_title("An agent's calls between one-off prompts: retention priorities")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
