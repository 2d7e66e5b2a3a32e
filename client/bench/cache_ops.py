"""Prefix-store operation cost with a million cached pages.

Builds a store of `--num-pages` pages (sequences of `--seq-pages` pages hanging off a few
shared "system prompt" trunks), then measures:
  - insert throughput (alloc_pages + insert of one whole sequence),
  - match throughput for a cached `--prompt-pages` prompt (fresh token lists, as a tokenizer
    would hand them over) and for a whole sequence,
  - the tree's cost of one cache-hit request: encode + match + lock + alloc (evicting one leaf,
    the pool is full) + insert + lock/unlock swap + final unlock,
and divides the last by the time of a cache-hit prefill (a `--suffix-len`-token forward of the
default model, or `--prefill-ms` when the model is not available).

    python -m client.bench.cache_ops --model DIR
    python -m client.bench.cache_ops --prefill-ms 33
Writes client/bench/results/cache_ops/summary.json.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from backend.cache import CacheConfig, PrefixStore, encode_tokens
from client.bench.common import write_summary

RESULTS = Path(__file__).resolve().parent / "results" / "cache_ops"
VOCAB = 151_936
GOAL = 0.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-pages", type=int, default=1_000_000)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seq-pages", type=int, default=1024, help="pages per cached sequence")
    p.add_argument("--num-trunks", type=int, default=16, help="shared system prompts")
    p.add_argument("--trunk-pages", type=int, default=16)
    p.add_argument("--prompt-pages", type=int, default=64, help="cached pages of a request")
    p.add_argument("--suffix-len", type=int, default=64, help="new tokens of a cache hit")
    p.add_argument("--num-queries", type=int, default=2000)
    p.add_argument("--model", type=Path, default=None, help="HF-format model directory")
    p.add_argument("--prefill-ms", type=float, default=None, help="used without --model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


class Workload:
    """Deterministic token sequences: sequence i is trunk i % num_trunks, then its own branch.
    Every call returns fresh int lists, as a tokenizer hands them over."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        size = args.page_size
        self.trunks = [
            self.rng.integers(0, VOCAB, args.trunk_pages * size) for _ in range(args.num_trunks)
        ]
        self.branch_pages = args.seq_pages - args.trunk_pages
        self.num_seqs = max(
            1, (args.num_pages - args.num_trunks * args.trunk_pages) // self.branch_pages
        )

    def sequence(self, i: int, num_pages: int | None = None) -> np.ndarray:
        """Sequence i, or its first `num_pages` pages (a shorter draw from the same seed is a
        prefix of the longer one)."""
        size = self.args.page_size
        num_pages = self.args.seq_pages if num_pages is None else num_pages
        trunk = self.trunks[i % len(self.trunks)][: num_pages * size]
        rng = np.random.default_rng((self.args.seed, i))
        return np.concatenate([trunk, rng.integers(0, VOCAB, num_pages * size - len(trunk))])


def build(store: PrefixStore, work: Workload) -> dict[str, Any]:
    """Inserts every sequence; returns insert throughput (store calls only)."""
    seconds, pages = 0.0, 0
    for i in tqdm(range(work.num_seqs), desc="build", unit="seq"):
        tokens = work.sequence(i).tolist()
        start = time.perf_counter()
        match = store.match_prefix(tokens)
        alloc = store.alloc_pages(len(tokens) // store.page_size - match.num_matched_pages)
        store.insert(
            tokens, None, match.kv_pages + alloc.kv_pages, match.anchor_blocks + alloc.anchor_blocks
        )
        seconds += time.perf_counter() - start
        pages += len(alloc.kv_pages)
    return {
        "sequences": work.num_seqs,
        "pages": pages,
        "insert_ops_per_s": work.num_seqs / seconds,
        "pages_per_s": pages / seconds,
        "mean_ms_per_insert": 1e3 * seconds / work.num_seqs,
    }


def bench_match(
    store: PrefixStore, work: Workload, num_pages: int, as_array: bool = False
) -> dict[str, Any]:
    """Matches of cached prompts given as int lists (or int32 arrays: the no-copy path)."""
    n = work.args.num_queries
    kind = "int32 array" if as_array else "list"
    seconds = 0.0
    # Queries are built one at a time (not timed): a list of 2000 64k-token lists is GBs.
    for i in tqdm(work.rng.integers(0, work.num_seqs, n), desc=f"match {num_pages} pages ({kind})"):
        seq = work.sequence(int(i), num_pages)
        query = seq.astype(np.int32) if as_array else seq.tolist()
        start = time.perf_counter()
        match = store.match_prefix(query)
        seconds += time.perf_counter() - start
        assert match.num_matched_pages == num_pages, "query missed"
    return {
        "prompt_pages": num_pages,
        "tokens": kind,
        "match_ops_per_s": n / seconds,
        "pages_per_s": n * num_pages / seconds,
        "mean_us": 1e6 * seconds / n,
    }


def request_tree_cost(store: PrefixStore, work: Workload) -> dict[str, Any]:
    """Tree time of cache-hit requests: cached prompt + a fresh `suffix_len`-token tail."""
    args, size = work.args, store.page_size
    new_pages = -(-args.suffix_len // size)  # the suffix, rounded up to whole pages
    times = []
    for i in tqdm(work.rng.integers(0, work.num_seqs, args.num_queries), desc="requests"):
        cached = work.sequence(int(i), args.prompt_pages).tolist()
        tokens = cached + work.rng.integers(0, VOCAB, new_pages * size).tolist()
        start = time.perf_counter()
        key = encode_tokens(tokens)  # once per request, shared by match and insert
        match = store.match_prefix(key)
        store.lock(match.nodes)
        alloc = store.alloc_pages(len(tokens) // size - match.num_matched_pages)
        result = store.insert(
            key, None, match.kv_pages + alloc.kv_pages, match.anchor_blocks + alloc.anchor_blocks
        )
        store.lock(result.nodes)
        store.unlock(match.nodes)
        store.unlock(result.nodes)  # the request finishes
        times.append(time.perf_counter() - start)
        assert match.num_matched_pages == args.prompt_pages, "request missed the cache"
    return {
        "mean_ms": 1e3 * statistics.fmean(times),
        "p50_ms": 1e3 * statistics.median(times),
        "p99_ms": 1e3 * float(np.percentile(times, 99)),
    }


def prefill_ms(args: argparse.Namespace) -> tuple[float, str]:
    """Median time of a `suffix_len`-token forward of the model, or `--prefill-ms`."""
    reason = "--model not given"
    if args.model is not None:
        try:
            from backend.model import load_model
        except ImportError as e:
            reason = f"backend.model.load_model unavailable ({e})"
        else:
            if (args.model / "config.json").is_file():
                return _time_model(load_model(args.model), args.suffix_len), f"model:{args.model}"
            reason = f"{args.model}/config.json not found"
    if args.prefill_ms is None:
        sys.exit(f"cache_ops: no prefill time ({reason}); pass --prefill-ms MS")
    return args.prefill_ms, f"cli:--prefill-ms ({reason})"


def _time_model(model: Any, suffix_len: int) -> float:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, suffix_len))
    model.logits(ids)  # warm-up
    times = []
    for _ in range(5):
        start = time.perf_counter()
        model.logits(ids)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prefill, source = prefill_ms(args)
    work = Workload(args)
    total = work.num_seqs * work.branch_pages + args.num_trunks * args.trunk_pages
    store = PrefixStore(
        CacheConfig(page_size=args.page_size, num_kv_pages=total, lookahead_window=0)
    )
    insert = build(store, work)
    match = bench_match(store, work, args.prompt_pages)
    match_array = bench_match(store, work, args.prompt_pages, as_array=True)
    match_long = bench_match(store, work, args.seq_pages)
    request = request_tree_cost(store, work)
    summary = {
        "num_cached_pages": store.num_cached_pages,
        "page_size": args.page_size,
        "match_ops_per_s": match["match_ops_per_s"],
        "insert_ops_per_s": insert["insert_ops_per_s"],
        "insert": insert,
        "match": match,
        "match_int32_array": match_array,
        "match_whole_sequence": match_long,
        "request_tree_cost": request,
        "prefill_ms": prefill,
        "prefill_source": source,
        "suffix_len": args.suffix_len,
        "tree_overhead_fraction": request["mean_ms"] / prefill,
        "goal_tree_overhead_fraction": GOAL,
        "meets_goal": request["mean_ms"] / prefill <= GOAL,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    write_summary(args.out, summary)
    return summary


if __name__ == "__main__":
    main()
