"""Soak: N minutes of concurrent streaming clients on loopback, with mixed prompt and output
lengths, shared prefixes and cancellations; reports errors, TTFT percentiles, and resident
memory and page-pool use at the start and the end (a leak shows as growth).

    python -m client.bench.soak --minutes 5 [--clients 32] [--cancel-fraction 0.2]
        [--system ours]
Starts its own server on a copy of model_repo/ (loopback, free ports), as configured there or,
with `--system`, as one of the benchmark suite's systems on a small device budget (2 MiB,
64 DRAM pages, 256 MiB of SSD: pages keep moving between the tiers); writes
client/bench/results/soak/summary.json (summary_<system>.json).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.config import ModelConfig
from backend.triton.llm_config import DEFAULT_MODEL_PATH
from backend.triton.repo import MODEL_REPO
from backend.triton.server import ServerHandle
from client.bench.common import bench_main, config_of
from client.bench.run_suite import k_max_of
from client.bench.serving import describe, served_repository
from client.bench.soak_probe import pool_use, server_rss_bytes, wait_idle
from client.bench.systems import SGLANG, SYSTEMS, Budget, system_params
from client.generate import GenerateError, GenerateParams, stream_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "soak"
# Shared "system prompts": requests start with one of them, so the prefix cache is exercised.
TRUNKS = [f"System prompt {i}: answer briefly and precisely. " * 6 for i in range(4)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--max-prompt", type=int, default=600, help="longest prompt (tokens)")
    p.add_argument("--max-output", type=int, default=48, help="most tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-every", type=float, default=15.0, help="seconds between samples")
    p.add_argument("--warmup-s", type=float, default=30.0, help="load before the start sample")
    p.add_argument("--system", choices=SYSTEMS + (SGLANG,),
                   help="serve one of the suite's systems (default: model_repo/ as it is)")
    p.add_argument("--out", type=Path,
                   help="default: results/soak/summary.json (summary_<system>.json)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / (f"summary_{args.system}.json" if args.system else "summary.json")
    return args


# --system: little device memory for the cache, so the tiers see traffic.
SOAK_BUDGET = Budget(device_budget_bytes=2 << 20, host_pages=64, ssd_bytes=256 << 20,
                     run_pages=400, max_num_seqs=8, max_tokens_per_step=512)


def server_params(system: str | None, ssd_dir: Path) -> dict[str, str]:
    """hybrid_llm parameters for `system` on SOAK_BUDGET ({} for model_repo/ as it is)."""
    if system is None:
        return {}
    model_dir = MODEL_REPO / "hybrid_llm" / DEFAULT_MODEL_PATH
    config = ModelConfig.from_file(model_dir / "config.json")
    params = system_params(system, config, SOAK_BUDGET, k_max_of(model_dir), ssd_dir)
    params["max_context_len"] = "4096"
    return params


@dataclass
class Tally:
    """What the clients saw; one lock guards it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0


def one_request(url: str, rng: random.Random, args: argparse.Namespace, tally: Tally) -> None:
    trunk = rng.choice(TRUNKS)
    tail = f" question {rng.randrange(10**6)}:" + " more" * rng.randrange(args.max_prompt // 5)
    prompt = (trunk + tail)[: rng.randrange(16, args.max_prompt)]
    max_tokens = rng.randrange(4, args.max_output + 1)
    cancel_after = rng.randrange(1, max_tokens + 1) if rng.random() < args.cancel_fraction else None
    params = GenerateParams(prompt, max_tokens=max_tokens, temperature=0.8, seed=rng.randrange(99))
    stream = stream_grpc(url, params)
    num_chunks, first = 0, None
    try:
        for chunk in stream:
            first = chunk.elapsed_s if first is None else first
            num_chunks += 1
            if cancel_after is not None and num_chunks >= cancel_after:
                stream.close()  # cancels the request on the server
                break
    except (GenerateError, OSError) as exc:
        with tally.lock:
            tally.errors.append(str(exc)[:300])
        return
    with tally.lock:
        tally.requests += 1
        tally.tokens += num_chunks
        tally.cancelled += cancel_after is not None and num_chunks >= cancel_after
        tally.completed += cancel_after is None or num_chunks < cancel_after
        if first is not None:
            tally.ttfts.append(first)


def client_loop(url: str, seed: int, deadline: float, args: argparse.Namespace, tally: Tally):
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        one_request(url, rng, args, tally)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    ssd_dir = Path(tempfile.mkdtemp(prefix="soak-ssd-"))
    try:
        return _run(args, tally, server_params(args.system, ssd_dir))
    finally:
        shutil.rmtree(ssd_dir, ignore_errors=True)


def _run(args: argparse.Namespace, tally: Tally, params: dict[str, str]) -> dict[str, Any]:
    with served_repository(params) as server:
        # Warm-up under the same load, so "start" is a steady state: allocator pools and
        # batch-shaped buffers grow during the first seconds of concurrency, then stay.
        warm = start_clients(server, args, time.monotonic() + args.warmup_s, Tally(), seed=-1)
        for thread in warm:
            thread.join()
        start = snapshot(server)
        began = time.monotonic()
        threads = start_clients(server, args, began + args.minutes * 60, tally, args.seed)
        timeline = sample_while(server, threads, began, args.sample_every)
        elapsed = time.monotonic() - began
        end = snapshot(server)
    return summarize(args, tally, start, end, elapsed, timeline)


def start_clients(
    server: ServerHandle, args: argparse.Namespace, deadline: float, tally: Tally, seed: int
) -> list[threading.Thread]:
    threads = [
        threading.Thread(
            target=client_loop,
            args=(server.urls.grpc, seed * 1000 + i, deadline, args, tally),
            daemon=True,
        )
        for i in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    return threads


def sample_while(
    server: ServerHandle, threads: list[threading.Thread], began: float, every_s: float
) -> list[dict[str, Any]]:
    """RSS and pool use every `every_s` seconds until the clients are done (growth shows)."""
    timeline = []
    while any(t.is_alive() for t in threads):
        wake = time.monotonic() + every_s
        for thread in threads:
            thread.join(timeout=max(0.0, wake - time.monotonic()))
        pages = pool_use(server)
        timeline.append(
            {
                "t_s": round(time.monotonic() - began, 1),
                "rss_mib": round(server_rss_bytes(server) / 2**20, 1),
                "pages_used": pages.get("used"),
                "pages_held": pages.get("held_by_requests"),
            }
        )
    return timeline


def snapshot(server: ServerHandle) -> dict[str, Any]:
    wait_idle(server)
    return {"rss_bytes": server_rss_bytes(server), "pages": pool_use(server)}


RSS_GROWTH_LIMIT_MIB = 256


def summarize(
    args, tally: Tally, start: dict, end: dict, elapsed: float, timeline: list
) -> dict[str, Any]:
    rss_growth = end["rss_bytes"] - start["rss_bytes"]
    held = end["pages"].get("held_by_requests", 0)
    return {
        "errors": len(tally.errors),
        "error_samples": tally.errors[:5],
        "requests": tally.requests,
        "completed": tally.completed,
        "cancelled": tally.cancelled,
        "tokens_streamed": tally.tokens,
        "tokens_per_s": round(tally.tokens / elapsed, 2),
        "ttft": describe(tally.ttfts),
        "start": start,
        "end": end,
        "rss_growth_mib": round(rss_growth / 2**20, 1),
        "pages_held_at_end": held,
        # Idle-to-idle RSS moves by tens of MiB run to run (allocator, caches); a leak of
        # per-shape oneDNN primitives once grew it by 1.5 GiB in 6 minutes.
        "rss_growth_limit_mib": RSS_GROWTH_LIMIT_MIB,
        "goal_met": not tally.errors and held == 0 and rss_growth / 2**20 <= RSS_GROWTH_LIMIT_MIB,
        "elapsed_s": round(elapsed, 1),
        "timeline": timeline,
        "config": config_of(args),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
