"""What the BLS model saves: the same streamed requests through the `ensemble` (each streamed
response a postprocessing request through Triton) and through `hybrid_llm_bls` (one model,
detokenizing in its process), to one server, alternating round by round.

A round sends `--concurrency` requests at once (greedy, `--max-tokens` tokens each, a fresh
cache salt each, so every prompt is prefilled) and waits for all; reported per model and
concurrency, as medians over `--rounds` rounds: mean TTFT, mean time between a request's
streamed tokens, and output tokens per second over the round.

    python -m client.bench.bls [--concurrency 1 8] [--rounds 6]
Writes client/bench/results/bls/summary.json and bls.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from client.bench.common import bench_main, config_of, grouped_bars, machine
from client.bench.overhead import prompt_of
from client.bench.serving import MODELS, served_repository, stream_at_once
from client.generate import GenerateParams

RESULTS = Path(__file__).resolve().parent / "results" / "bls"
PATHS = ("ensemble", "hybrid_llm_bls")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def one_round(url: str, model: str, n: int, r: int, args: argparse.Namespace) -> dict:
    requests = [GenerateParams(prompt_of(args.prompt_tokens, 1000 * r + i),
                               max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                               top_k=1, cache_salt=uuid.uuid4().hex) for i in range(n)]
    start = time.perf_counter()
    results = stream_at_once(url, requests, model)
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    if tokens != n * args.max_tokens:
        raise RuntimeError(f"{model}: {tokens} tokens, expected {n * args.max_tokens}")
    return {"ttft_s": statistics.fmean(r["first_token_s"] for r in results),
            "itl_s": statistics.fmean((r["done_s"] - r["first_token_s"]) /
                                      (args.max_tokens - 1) for r in results),
            "tokens_per_s": tokens / wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = {n: {p: [] for p in PATHS} for n in args.concurrency}
    with served_repository(models=(*MODELS, "hybrid_llm_bls")) as server:
        url = server.urls.grpc
        for p in PATHS:  # warm-up
            one_round(url, p, 2, -1, args)
        total = args.rounds * len(args.concurrency) * len(PATHS)
        with tqdm(total=total, desc="bls", unit="round") as bar:
            for r in range(args.rounds):
                for n in args.concurrency:
                    for p in (PATHS if r % 2 == 0 else PATHS[::-1]):
                        rows[n][p].append(one_round(url, p, n, r, args))
                        bar.update()
    results = {str(n): {p: {"ttft_ms": round(1000 * statistics.median(x["ttft_s"] for x in v), 1),
                            "itl_ms": round(1000 * statistics.median(x["itl_s"] for x in v), 2),
                            "tokens_per_s": round(statistics.median(x["tokens_per_s"]
                                                                   for x in v), 1)}
                        for p, v in by.items()}
               for n, by in rows.items()}
    ratio = {n: round(by["hybrid_llm_bls"]["tokens_per_s"] / by["ensemble"]["tokens_per_s"], 3)
             for n, by in results.items()}
    summary = {"benchmark": "bls", "date": time.strftime("%Y-%m-%d %H:%M"),
               "machine": machine(), "config": config_of(args), "results": results,
               "bls_throughput_vs_ensemble": ratio,
               "note": "the same greedy streamed requests to one server through the ensemble "
                       "and through hybrid_llm_bls, alternating round by round; medians over "
                       "rounds; times seen by the clients"}
    plot(results, args.out.with_name("bls.png"))
    return summary


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    grouped_bars(results, PATHS, (("ttft_ms", "mean TTFT (ms)"),
                                  ("itl_ms", "mean inter-token time (ms)"),
                                  ("tokens_per_s", "output tokens / s")),
                 lambda n: f"{n} at once",
                 "Streaming through the ensemble vs hybrid_llm_bls (one server)", path,
                 (11, 3.5))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
