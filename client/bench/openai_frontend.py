"""What the OpenAI-compatible frontend costs: the same greedy requests sent straight to Triton
(gRPC streaming, `client.generate.stream_grpc`) and through `backend.openai_api` with the
OpenAI SDK (`/v1/completions`, streamed), without and with `logprobs` = 5 (each token's log
probability and five alternatives), to one server, alternating request by request.

Reported per path and prompt length: time to first token and the mean time between the
following tokens (both from the client's side), the frontend's extra milliseconds and what
logprobs add to them. Each
request carries its own cache salt, so neither path gets a cache hit the other did not.

    python -m client.bench.openai_frontend [--prompt-tokens 64 1024] [--rounds 10]
Writes client/bench/results/openai_frontend/summary.json and openai_frontend.png.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from client.bench.common import bench_main, config_of, grouped_bars, machine
from client.bench.overhead import prompt_of
from client.bench.serving import served_repository
from client.generate import GenerateParams, stream_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "openai_frontend"
PATHS = ("triton_grpc", "openai_frontend", "openai_logprobs")
LOGPROBS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


@contextmanager
def frontend(grpc_url: str, repository: str, port: int, *extra: str):
    """The frontend as its own process (`extra`: more of its flags); yields its /v1 base
    URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "backend.openai_api", "--triton-url", grpc_url,
         "--model-repository", repository, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the OpenAI frontend did not start: "
                                       + (process.stderr.read().decode()
                                          if process.poll() is not None else "timeout")) from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=20)


def via_triton(url: str, prompt: str, args: argparse.Namespace) -> dict[str, float]:
    params = GenerateParams(prompt, max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                            top_k=1, cache_salt=uuid.uuid4().hex)
    times = [c.elapsed_s for c in stream_grpc(url, params) if c.text]
    return _row(times)


def via_openai(client: Any, prompt: str, args: argparse.Namespace,
               logprobs: int | None = None) -> dict[str, float]:
    start = time.perf_counter()
    times = []
    for event in client.completions.create(
            model="ensemble", prompt=prompt, max_tokens=args.max_tokens, stream=True,
            logprobs=logprobs, extra_body={"top_k": 1, "min_tokens": args.max_tokens,
                                           "cache_salt": uuid.uuid4().hex}):
        if event.choices and event.choices[0].text:
            times.append(time.perf_counter() - start)
            if logprobs is not None and not event.choices[0].logprobs.tokens:
                raise RuntimeError("a streamed token came without its logprobs")
    return _row(times)


def _row(times: list[float]) -> dict[str, float]:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0], "itl_s": statistics.fmean(gaps) if gaps else 0.0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    from backend.triton.repo import free_ports

    rows: dict[int, dict[str, list]] = {n: {p: [] for p in PATHS} for n in args.prompt_tokens}
    with served_repository() as server:
        [port] = free_ports(1)
        with frontend(server.urls.grpc, str(server.model_repository), port) as base:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            via_triton(server.urls.grpc, prompt_of(64, -1), args)  # warm-up, both paths
            via_openai(client, prompt_of(64, -2), args)
            via_openai(client, prompt_of(64, -3), args, LOGPROBS)
            total = args.rounds * len(args.prompt_tokens) * len(PATHS)
            with tqdm(total=total, desc="openai_frontend", unit="req") as bar:
                for r in range(args.rounds):
                    for n in args.prompt_tokens:
                        prompt = prompt_of(n, r)
                        order = PATHS if r % 2 == 0 else PATHS[::-1]
                        for path in order:
                            row = (via_triton(server.urls.grpc, prompt, args)
                                   if path == "triton_grpc" else via_openai(
                                       client, prompt, args,
                                       LOGPROBS if path == "openai_logprobs" else None))
                            rows[n][path].append(row)
                            bar.update()
    return summarize(args, rows)


def _stats(rows: list[dict[str, float]]) -> dict[str, float]:
    ttft = [r["ttft_s"] * 1000 for r in rows]
    itl = [r["itl_s"] * 1000 for r in rows]
    return {"ttft_mean_ms": round(statistics.fmean(ttft), 1),
            "ttft_p50_ms": round(statistics.median(ttft), 1),
            "itl_mean_ms": round(statistics.fmean(itl), 2)}


def summarize(args: argparse.Namespace, rows: dict) -> dict[str, Any]:
    results = {str(n): {p: _stats(r[p]) for p in PATHS} for n, r in rows.items()}
    extra = {n: _extra(r, "openai_frontend", "triton_grpc") for n, r in results.items()}
    summary = {
        "results": results,
        "frontend_extra": extra,
        "logprobs_extra": {n: _extra(r, "openai_logprobs", "openai_frontend")
                           for n, r in results.items()},
        "note": "the same greedy requests (a fresh cache salt each) to one server, straight "
                "over gRPC streaming and through the OpenAI frontend with the OpenAI SDK, "
                f"alternating, the frontend also with logprobs={LOGPROBS}; times seen by the "
                "client; itl: mean gap between streamed tokens",
        "config": config_of(args),
        "machine": machine(),
    }
    plot(results, args.out.with_name("openai_frontend.png"))
    return summary


def _extra(r: dict[str, dict[str, float]], path: str, base: str) -> dict[str, float]:
    """What `path` adds to `base`'s mean TTFT and inter-token time (ms)."""
    return {"ttft_ms": round(r[path]["ttft_mean_ms"] - r[base]["ttft_mean_ms"], 1),
            "itl_ms": round(r[path]["itl_mean_ms"] - r[base]["itl_mean_ms"], 2)}


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    grouped_bars(results, PATHS, (("ttft_mean_ms", "mean time to first token (ms)"),
                                  ("itl_mean_ms", "mean inter-token time (ms)")),
                 lambda n: f"{n}-token prompt",
                 "Triton gRPC streaming vs the OpenAI frontend (one server)", path, (9, 3.5))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
