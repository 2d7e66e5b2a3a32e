"""KV-aware routing over two replicas: multi-turn chats through the OpenAI frontend, once with
the replicas' KV cache events (`--kv-events`: each prompt to the replica that announced the
longest part of it) and once without (each to the least busy replica, in turn: what a plain
load balancer does). Both frontends front the same two tritonservers; each system has chats
of its own (their own system prompts); each round sends every chat's next turn, the chats in a new
(seeded) order, to the two systems in turn (each request to both before the next), so the
host's noise lands on both alike.

Reported per system: the later turns' time to first token (mean, median, P95; the first turn
of a chat is cold either way) and the share of their prompt tokens served from a cache.

    python -m client.bench.router [--chats 6] [--turns 4] [--system-tokens 512]
Writes client/bench/results/router/summary.json and router.png.
"""

from __future__ import annotations

import argparse
import random
import time
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
from client.bench.openai_frontend import frontend
from client.bench.overhead import prompt_of
from client.bench.serving import free_ports, served_repository

RESULTS = Path(__file__).resolve().parent / "results" / "router"
SYSTEMS = ("kv_aware", "in_turn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="the order of the chats in each round")
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def ask(client: Any, messages: list[dict[str, str]], args: argparse.Namespace,
        ) -> tuple[dict[str, float], str]:
    """One streamed chat turn: its time to first token, cached and prompt tokens; the text."""
    start = time.perf_counter()
    first, text, usage = None, "", None
    for chunk in client.chat.completions.create(
            model="ensemble", messages=messages, max_tokens=args.max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"top_k": 1}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - start
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"ttft_s": first or time.perf_counter() - start, "cached": cached,
            "prompt": usage.prompt_tokens}, text


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    rows: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
    with ExitStack() as stack:
        replicas, events = [], []
        for _ in range(2):
            pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
            replicas.append(stack.enter_context(served_repository(
                {"kv_events_endpoint": pub, "kv_events_replay_endpoint": replay})))
            events += ["--kv-events", f"{pub},{replay}"]
        first, second = replicas
        common = (first.urls.grpc, str(first.model_repository))
        more = ("--triton-url", second.urls.grpc)
        ports = free_ports(2)
        bases = {"kv_aware": stack.enter_context(frontend(*common, ports[0], *more, *events)),
                 "in_turn": stack.enter_context(frontend(*common, ports[1], *more))}
        clients = {s: openai.OpenAI(base_url=b, api_key="unused", max_retries=0, timeout=300)
                   for s, b in bases.items()}
        chats = {s: [[{"role": "system", "content": prompt_of(args.system_tokens, 1000 * i + j)
                       + uuid.uuid4().hex}] for j in range(args.chats)]
                 for i, s in enumerate(SYSTEMS)}
        with tqdm(total=args.turns * args.chats * len(SYSTEMS), desc="router", unit="req") as bar:
            order = random.Random(args.seed)
            for turn in range(args.turns):  # the chats' turns come in a new order each round
                for c in order.sample(range(args.chats), args.chats):
                    for system in SYSTEMS:
                        messages = chats[system][c]
                        messages.append({"role": "user", "content": f"Turn {turn}: and then?"})
                        row, text = ask(clients[system], messages, args)
                        messages.append({"role": "assistant", "content": text})
                        row["turn"] = turn
                        rows[system].append(row)
                        bar.update()
                time.sleep(0.2)  # the replicas' last events reach the router
    return summarize(args, rows)


def summarize(args: argparse.Namespace, rows: dict[str, list]) -> dict[str, Any]:
    later = {s: [r for r in rs if r["turn"] > 0] for s, rs in rows.items()}
    results = {s: {"later_turns": ttft_stats(later[s]),
                   "first_turns": ttft_stats([r for r in rows[s] if r["turn"] == 0])}
               for s in SYSTEMS}
    summary = {
        "results": results,
        "later_turn_ttft_speedup_kv_aware_vs_in_turn": round(
            results["in_turn"]["later_turns"]["ttft_mean_ms"]
            / results["kv_aware"]["later_turns"]["ttft_mean_ms"], 2),
        "note": "two replicas (tritonservers) on one host; later_turns: every turn after a "
                "chat's first; cached_fraction: prompt tokens served from a replica's cache; "
                "TTFT from the client's side, one request at a time",
        "config": config_of(args),
        "machine": machine(),
    }
    plot(results, args.out.with_name("router.png"))
    return summary


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    means = [results[s]["later_turns"]["ttft_mean_ms"] for s in SYSTEMS]
    bars = ax.bar(SYSTEMS, means, color=["tab:green", "tab:gray"])
    for bar, s in zip(bars, SYSTEMS):
        ax.annotate(f"{results[s]['later_turns']['cached_fraction']:.0%} cached",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("mean time to first token, later turns (ms)")
    ax.set_title("Chats over two replicas: KV-aware routing vs in turn")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
