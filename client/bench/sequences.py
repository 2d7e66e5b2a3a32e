"""K sequences from one prompt through the served ensemble: `num_return_sequences` K (the
siblings start from the first sequence's cached prompt) against what a client does without
it, K requests of the same prompt sent at once (each in its own cache namespace, or all in one,
where they arrive before anything is cached: the later ones wait for the first one's prefill,
`share_running_prefills`).

For each prompt length and repeat (a fresh cache salt each, so every run starts cold), all
three ways run one after another in rotating order. Reported per way: the time until every
sequence has its first token, until all finished, and the prompt tokens prefilled (summed
over the sequences: `recomputed_tokens`).

    python -m client.bench.sequences [--k 4] [--prompt-lens 1024,2048] [--repeats 3]
Writes client/bench/results/sequences/summary.json.
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from client.bench.common import bench_main, config_of, machine, median_row
from client.bench.overhead import prompt_of
from client.bench.serving import served_repository, stream_at_once
from client.generate import GenerateParams, stream_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "sequences"
WAYS = ("num_return_sequences", "k_requests_own_salts", "k_requests_one_salt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-lens", default="1024,2048", help="prompt lengths (tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def params(prompt: str, args: argparse.Namespace, salt: str, **extra) -> GenerateParams:
    return GenerateParams(prompt, max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                          temperature=0.8, seed=7, cache_salt=salt, **extra)


def one_request(url: str, prompt: str, args: argparse.Namespace) -> dict[str, float]:
    """One request for K sequences."""
    first: dict[int, float] = {}
    recomputed: dict[int, int] = {}
    end = 0.0
    for c in stream_grpc(url, params(prompt, args, uuid.uuid4().hex,
                                     num_return_sequences=args.k)):
        if c.counts.get("num_output_tokens"):
            first.setdefault(c.sequence_index, c.elapsed_s)
        if c.sequence_index >= 0 and "recomputed_tokens" in c.counts:
            recomputed[c.sequence_index] = c.counts["recomputed_tokens"]
        end = c.elapsed_s
    assert len(first) == args.k, first
    return {"all_first_token_s": max(first.values()), "all_done_s": end,
            "recomputed_tokens": sum(recomputed.values())}


def k_requests(url: str, prompt: str, args: argparse.Namespace, one_salt: bool
               ) -> dict[str, float]:
    """K requests of the prompt at once, from K threads."""
    salt = uuid.uuid4().hex
    requests = [replace(params(prompt, args, salt if one_salt else f"{salt}-{k}"), seed=7 + k)
                for k in range(args.k)]
    results = stream_at_once(url, requests)
    return {"all_first_token_s": max(r["first_token_s"] for r in results),
            "all_done_s": max(r["done_s"] for r in results),
            "recomputed_tokens": sum(r["recomputed_tokens"] for r in results)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    lens = [int(n) for n in args.prompt_lens.split(",")]
    ways = {
        "num_return_sequences": one_request,
        "k_requests_own_salts": lambda u, p, a: k_requests(u, p, a, one_salt=False),
        "k_requests_one_salt": lambda u, p, a: k_requests(u, p, a, one_salt=True),
    }
    runs: dict[int, dict[str, list[dict[str, float]]]] = {n: {w: [] for w in WAYS} for n in lens}
    with served_repository() as server:
        url = server.urls.grpc
        one_request(url, prompt_of(64, -1), args)  # warm-up: lazy initialisation
        for n in lens:
            for r in range(args.repeats):
                order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]
                for way in order:
                    runs[n][way].append(ways[way](url, prompt_of(n, r), args))
    return summarize(args, runs)


def summarize(args: argparse.Namespace, runs: dict) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for n, by_way in runs.items():
        row = {}
        for way, results in by_way.items():
            row[way] = median_row(results)
        base = row["k_requests_own_salts"]
        ours = row["num_return_sequences"]
        row["all_done_speedup_vs_own_salts"] = round(base["all_done_ms"] / ours["all_done_ms"],
                                                     2)
        row["all_first_token_speedup_vs_own_salts"] = round(
            base["all_first_token_ms"] / ours["all_first_token_ms"], 2)
        row["prefilled_ratio_vs_own_salts"] = round(
            ours["recomputed_tokens"] / base["recomputed_tokens"], 3)
        table[str(n)] = row
    return {
        "by_prompt_tokens": table,
        "note": "times in ms (medians over repeats); recomputed_tokens summed over the K "
                "sequences",
        "config": config_of(args),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
