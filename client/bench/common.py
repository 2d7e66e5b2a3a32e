"""What every benchmark shares: the default model's path, argument basics, writing results."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "model_repo/hybrid_llm/1/tiny_qwen3_5"


def model_parser(doc: str) -> argparse.ArgumentParser:
    """`--model DIR` (default: the default model) and `--quick`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--quick", action="store_true")
    return p


def write_summary(path: Path, summary: dict[str, Any], echo: bool = True) -> Path:
    """Writes summary.json (creating its folder) and prints it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    if echo:
        print(json.dumps(summary, indent=2))
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lays out a matplotlib figure, writes it to `path` as a PNG (creating its folder) and
    closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def grouped_bars(results: Mapping[str, Mapping[str, Mapping[str, float]]],
                 series: Sequence[str], panels: Sequence[tuple[str, str]],
                 tick: Callable[[str], str], title: str, path: Path,
                 figsize: tuple[float, float]) -> Path:
    """One panel per (key, y label) of `panels`; in each, a group of bars per key of
    `results` (its x tick `tick(group)`), one bar per `series`: results[group][series][key]."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=figsize)
    groups = list(results)
    width = 0.8 / len(series)
    for ax, (key, label) in zip(axes, panels):
        for j, name in enumerate(series):
            offset = (j - (len(series) - 1) / 2) * width
            ax.bar([i + offset for i in range(len(groups))],
                   [results[g][name][key] for g in groups], width=width, label=name)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([tick(g) for g in groups])
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(title)
    return save_figure(fig, path)


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's arguments as its summary records them (not where it writes)."""
    return {k: v for k, v in vars(args).items() if k != "out"}


def median_row(results: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over repeated measurements, rounded to 0.1; keys in seconds
    (`*_s`, not rates: `*_per_s`) become milliseconds (`*_ms`)."""
    def seconds(key: str) -> bool:
        return key.endswith("_s") and not key.endswith("_per_s")

    return {(key[:-2] + "_ms" if seconds(key) else key):
            round(statistics.median(r[key] for r in results) * (1000 if seconds(key) else 1), 1)
            for key in results[0]}


def machine() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform()}


def bench_main(parse_args: Callable[[list[str] | None], argparse.Namespace],
               run: Callable[[argparse.Namespace], dict[str, Any]],
               argv: list[str] | None) -> dict[str, Any]:
    """A benchmark's entry point: parse `argv`, run, write the summary to `args.out`."""
    args = parse_args(argv)
    summary = run(args)
    write_summary(args.out, summary)
    return summary


class OutputTimes:
    """An in-process engine's outputs as they arrive (`on_output`): each request's first and
    last token times, its token count, and the requests finished."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.done: list[str] = []

    def on_output(self, out) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            self.first.setdefault(out.request_id, now)
            self.last[out.request_id] = now
            self.counts[out.request_id] = self.counts.get(out.request_id, 0) + \
                len(out.new_token_ids)
        if out.finished:
            self.done.append(out.request_id)

    def decode_tokens_per_s(self) -> float:
        """Tokens after each request's first, over the time from the first first token to
        the last token."""
        tokens = sum(self.counts.values()) - len(self.counts)
        return tokens / (max(self.last.values()) - min(self.first.values()))


def ttft_stats(rows: list[dict[str, float]]) -> dict[str, float]:
    """Requests' time to first token (`ttft_s`: mean, median, P95 in ms) and the share of
    their prompt tokens (`prompt`) served from the cache (`cached`)."""
    ttft = sorted(r["ttft_s"] * 1000 for r in rows)
    return {"requests": len(rows),
            "ttft_mean_ms": round(statistics.fmean(ttft), 1),
            "ttft_p50_ms": round(statistics.median(ttft), 1),
            "ttft_p95_ms": round(ttft[max(0, math.ceil(0.95 * len(ttft)) - 1)], 1),
            "cached_fraction": round(sum(r["cached"] for r in rows)
                                     / max(1, sum(r["prompt"] for r in rows)), 3)}
