"""Interactive requests beside a batch job, with and without request priorities, on one real
tritonserver whose run slots (`max_num_seqs`) the batch job keeps full.

`--batch-clients` clients send long requests back to back (a `--batch-prompt-tokens` prompt,
`--batch-tokens` generated) while one interactive client sends short ones (a
`--chat-prompt-tokens` prompt, `--chat-tokens` generated), one at a time. Two modes alternate
phase by phase on the same server, so the host's noise lands on both:

- `equal`: every request at priority 0: a chat request waits for a batch request to end;
- `prioritized`: the batch job at priority `--batch-priority` (5): a chat request (0) takes
  the slot of a running batch request, which recomputes from its cached pages later.

A phase starts once every batch client runs a request of its mode. Reported per mode: the
chat requests' time to first token (mean, median, P95) and end-to-end latency, and the batch
job's tokens streamed per second during the phases (what the preemptions cost it).

    python -m client.bench.priority [--rounds 6] [--chats-per-phase 4]
Writes client/bench/results/priority/summary.json and priority.png.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
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

RESULTS = Path(__file__).resolve().parent / "results" / "priority"
MODES = ("equal", "prioritized")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=4, help="the server's max_num_seqs")
    p.add_argument("--batch-clients", type=int, default=4)
    p.add_argument("--batch-prompt-tokens", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=96)
    p.add_argument("--batch-priority", type=int, default=5)
    p.add_argument("--chat-prompt-tokens", type=int, default=64)
    p.add_argument("--chat-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6, help="phases of each mode")
    p.add_argument("--chats-per-phase", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


class BatchJob:
    """Clients sending long requests back to back, each at the priority of the mode current
    when it is sent; `streamed` counts the tokens they have received so far."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.mode = MODES[0]
        self.running = [""] * args.batch_clients  # the mode of each client's request
        self.streamed = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(args.batch_clients)]
        self.sent = 0

    def __enter__(self) -> BatchJob:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)

    def switch(self, mode: str, timeout_s: float = 300.0) -> None:
        """Sets the mode and waits until every client runs a request of it."""
        self.mode = mode
        deadline = time.monotonic() + timeout_s
        while any(m != mode for m in self.running):
            if time.monotonic() > deadline:
                raise RuntimeError("the batch clients did not switch mode")
            time.sleep(0.01)

    def _client(self, i: int) -> None:
        args = self.args
        while not self.stop.is_set():
            with self.lock:
                mode, self.sent = self.mode, self.sent + 1
                n = self.sent
            priority = args.batch_priority if mode == "prioritized" else 0
            params = GenerateParams(prompt_of(args.batch_prompt_tokens, 50_000 + n),
                                    max_tokens=args.batch_tokens, min_tokens=args.batch_tokens,
                                    top_k=1, priority=priority, cache_salt=uuid.uuid4().hex)
            self.running[i] = mode
            for chunk in stream_grpc(self.url, params):
                with self.lock:  # a streamed response counts the tokens it carries
                    self.streamed += chunk.counts.get("num_output_tokens", 0)


def chat(url: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    params = GenerateParams(prompt_of(args.chat_prompt_tokens, 90_000 + n),
                            max_tokens=args.chat_tokens, min_tokens=args.chat_tokens, top_k=1,
                            priority=0, cache_salt=uuid.uuid4().hex)
    first = last = None
    counts: dict[str, int] = {}
    for chunk in stream_grpc(url, params):
        if chunk.text:
            first = chunk.elapsed_s if first is None else first
            last = chunk.elapsed_s
        counts = chunk.counts or counts
    return {"ttft_s": first or 0.0, "e2e_s": last or 0.0,
            "cached": counts.get("cached_tokens", 0), "prompt": counts.get("num_input_tokens", 0)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    chats: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    phase_s = {m: 0.0 for m in MODES}
    tokens = {m: 0 for m in MODES}  # batch tokens streamed during each mode's phases
    with served_repository({"max_num_seqs": str(args.slots)}) as server:
        url = server.urls.grpc
        chat(url, -1, args)  # warm-up
        with BatchJob(url, args) as job:
            total = args.rounds * len(MODES) * args.chats_per_phase
            with tqdm(total=total, desc="priority", unit="chat") as bar:
                n = 0
                for r in range(args.rounds):
                    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                        job.switch(mode)
                        start, streamed = time.perf_counter(), job.streamed
                        for _ in range(args.chats_per_phase):
                            chats[mode].append(chat(url, n, args))
                            n += 1
                            bar.update()
                            time.sleep(0.05)
                        phase_s[mode] += time.perf_counter() - start
                        tokens[mode] += job.streamed - streamed
    return summarize(args, chats, phase_s, tokens)


def _stats(rows: list[dict[str, float]]) -> dict[str, float]:
    return {**ttft_stats(rows),
            "e2e_mean_ms": round(statistics.fmean(r["e2e_s"] * 1000 for r in rows), 1)}


def summarize(args: argparse.Namespace, chats: dict, phase_s: dict,
              tokens: dict) -> dict[str, Any]:
    results = {m: {"chat": _stats(chats[m]),
                   "batch_tokens_per_s": round(tokens[m] / max(phase_s[m], 1e-9), 1)}
               for m in MODES}
    summary = {
        "results": results,
        "chat_ttft_speedup_prioritized_vs_equal": round(
            results["equal"]["chat"]["ttft_mean_ms"]
            / results["prioritized"]["chat"]["ttft_mean_ms"], 2),
        "batch_throughput_ratio_prioritized_vs_equal": round(
            results["prioritized"]["batch_tokens_per_s"]
            / max(results["equal"]["batch_tokens_per_s"], 1e-9), 3),
        "note": "chat: the interactive client's requests, one at a time, TTFT and end-to-end "
                "from the client's side; batch_tokens_per_s: the batch job's tokens streamed "
                "during the mode's phases over their length (every batch request running then "
                "was sent in that mode)",
        "config": config_of(args),
        "machine": machine(),
    }
    plot(results, args.out.with_name("priority.png"))
    return summary


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    colors = ["tab:gray", "tab:green"]
    means = [results[m]["chat"]["ttft_mean_ms"] for m in MODES]
    bars = left.bar(MODES, means, color=colors)
    left.scatter(MODES, [results[m]["chat"]["ttft_p95_ms"] for m in MODES], color="black",
                 marker="_", s=400, label="P95", zorder=3)
    for bar, v in zip(bars, means):
        left.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                      va="bottom", fontsize=9)
    left.set_ylabel("chat: mean time to first token (ms)")
    left.legend()
    values = [results[m]["batch_tokens_per_s"] for m in MODES]
    right.bar(MODES, values, color=colors)
    right.set_ylabel("batch job: generated tokens / s")
    fig.suptitle("Interactive requests beside a batch job that fills every slot")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
