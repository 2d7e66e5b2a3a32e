"""A burst of requests that share a long prefix (one system prompt or document set, each with
its own question), sent at once to a cold cache: `share_running_prefills` on (a request waits
for the first one's prefill of the shared pages and resumes from them) against off (every
request admitted at once prefills the whole prefix beside the others).

Two servers run side by side, one per setting, used one after the other in alternating
order; each repeat takes a fresh cache salt (one for the whole burst), so every burst starts
cold. Reported per setting (medians over repeats): mean and slowest time to first token, the
time until every request is done, and the prompt tokens prefilled over the burst.

    python -m client.bench.burst [--clients 8] [--prefix-lens 1024,2048] [--repeats 3]
Writes client/bench/results/burst/summary.json.
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from client.bench.common import bench_main, config_of, machine, median_row
from client.bench.overhead import prompt_of
from client.bench.serving import served_repository, stream_at_once
from client.generate import GenerateParams

RESULTS = Path(__file__).resolve().parent / "results" / "burst"
SETTINGS = ("share", "no_share")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8, help="requests in a burst")
    p.add_argument("--prefix-lens", default="1024,2048", help="shared prefix lengths (tokens)")
    p.add_argument("--suffix", type=int, default=64, help="tokens of each request's own part")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def burst(url: str, prefix: str, args: argparse.Namespace) -> dict[str, float]:
    """One burst: `args.clients` requests of [prefix : own part] at once, one fresh salt."""
    salt = uuid.uuid4().hex
    requests = [GenerateParams(prefix + prompt_of(args.suffix, 1000 + k),
                               max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                               top_k=1, cache_salt=salt)
                for k in range(args.clients)]
    results = stream_at_once(url, requests)
    firsts = [r["first_token_s"] for r in results]
    return {"mean_first_token_s": statistics.fmean(firsts),
            "max_first_token_s": max(firsts),
            "all_done_s": max(r["done_s"] for r in results),
            "recomputed_tokens": sum(r["recomputed_tokens"] for r in results)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    lens = [int(n) for n in args.prefix_lens.split(",")]
    runs = {n: {s: [] for s in SETTINGS} for n in lens}
    with ExitStack() as stack:
        urls = {}
        for setting in SETTINGS:
            share = "true" if setting == "share" else "false"
            server = stack.enter_context(served_repository({"share_running_prefills": share}))
            urls[setting] = server.urls.grpc
            burst(urls[setting], prompt_of(128, -1), args)  # warm-up: lazy initialisation
        for n in lens:
            for r in range(args.repeats):
                order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
                for setting in order:
                    runs[n][setting].append(burst(urls[setting], prompt_of(n, r), args))
    return summarize(args, runs)


def summarize(args: argparse.Namespace, runs: dict) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for n, by_setting in runs.items():
        row: dict[str, Any] = {}
        for setting, results in by_setting.items():
            row[setting] = median_row(results)
        on, off = row["share"], row["no_share"]
        for key in ("mean_first_token_ms", "max_first_token_ms", "all_done_ms"):
            row[f"{key[:-3]}_speedup"] = round(off[key] / on[key], 2)
        row["prefilled_ratio"] = round(on["recomputed_tokens"] / off["recomputed_tokens"], 3)
        table[str(n)] = row
    return {
        "by_prefix_tokens": table,
        "note": "times in ms (medians over repeats; a request's times from when it was sent); "
                "recomputed_tokens summed over the burst; speedups are no_share / share",
        "config": config_of(args),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
