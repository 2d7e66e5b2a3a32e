"""Triton overhead: TTFT and per-token latency through the served ensemble versus the same
engine in-process, on the same requests.

Each request runs once through Triton (gRPC streaming: tokenize, engine, detokenize, transport)
and once in-process (ids in, `on_output` callbacks), alternately, one at a time, each with its
own cache salt so every prefill is cold. Goal (issue 7): Triton TTFT <= 1.1x in-process, or
within 5 ms.

    python -m client.bench.overhead [--num-requests 16] [--max-tokens 32]
Writes client/bench/results/overhead/summary.json.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

from backend.engine import Engine, Request, RequestOutput, SamplingParams
from client.bench.common import bench_main, config_of, machine
from client.bench.serving import describe, in_process_engine, served_repository
from client.generate import GenerateParams, stream_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "overhead"
GOAL_RATIO, GOAL_MS = 1.1, 5.0
WORDS = "the model reads a prompt and streams tokens back through the server".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-lens", default="64,256,512", help="prompt lengths (tokens)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def prompt_of(num_tokens: int, i: int) -> str:
    """ASCII text of num_tokens bytes (one token each for the byte tokenizer)."""
    text = f"request {i}:"
    while len(text) < num_tokens:
        text += " " + WORDS[len(text) % len(WORDS)]
    return text[:num_tokens]


def timed_triton(url: str, prompt: str, max_tokens: int, salt: str) -> tuple[float, float]:
    """(TTFT, mean seconds per later token) of one streamed request."""
    params = GenerateParams(
        prompt, max_tokens=max_tokens, min_tokens=max_tokens, top_k=1, cache_salt=salt
    )
    times = [c.elapsed_s for c in stream_grpc(url, params) if c.counts.get("num_output_tokens")]
    return times[0], (times[-1] - times[0]) / max(1, len(times) - 1)


def timed_local(engine: Engine, ids: list[int], max_tokens: int, salt: str) -> tuple[float, float]:
    times: list[float] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        if out.new_token_ids:
            times.append(time.perf_counter())
        if out.finished:
            done.set()

    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, top_k=1)
    start = time.perf_counter()
    engine.submit(Request(f"local-{salt}", ids, sampling, cache_salt=salt, on_output=on_output))
    done.wait()
    return times[0] - start, (times[-1] - times[0]) / max(1, len(times) - 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    lens = [int(n) for n in args.prompt_lens.split(",")]
    prompts = [prompt_of(lens[i % len(lens)], i) for i in range(args.warmup + args.num_requests)]
    triton: list[tuple[float, float]] = []
    local: list[tuple[float, float]] = []
    with served_repository() as server:
        engine = in_process_engine(server)
        engine.start()
        try:
            for i, prompt in enumerate(prompts):
                ids = engine.tokenizer.encode(prompt)
                t = timed_triton(server.urls.grpc, prompt, args.max_tokens, f"triton-{i}")
                loc = timed_local(engine, ids, args.max_tokens, f"local-{i}")
                if i >= args.warmup:
                    triton.append(t)
                    local.append(loc)
        finally:
            engine.stop()
    return summarize(args, triton, local)


def summarize(args: argparse.Namespace, triton: list, local: list) -> dict[str, Any]:
    t_ttft, l_ttft = describe([t for t, _ in triton]), describe([t for t, _ in local])
    t_tpot, l_tpot = describe([p for _, p in triton]), describe([p for _, p in local])
    ratio = t_ttft["mean_ms"] / l_ttft["mean_ms"]
    overhead_ms = t_ttft["mean_ms"] - l_ttft["mean_ms"]
    return {
        "triton_ttft_ratio": round(ratio, 3),
        "triton_ttft_overhead_ms": round(overhead_ms, 3),
        "triton_tpot_ratio": round(t_tpot["mean_ms"] / l_tpot["mean_ms"], 3),
        "meets_goal": ratio <= GOAL_RATIO or overhead_ms <= GOAL_MS,
        "goal": f"TTFT ratio <= {GOAL_RATIO} or overhead <= {GOAL_MS} ms",
        "ttft": {"triton": t_ttft, "in_process": l_ttft},
        "per_token": {"triton": t_tpot, "in_process": l_tpot},
        "config": config_of(args),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
