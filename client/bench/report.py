"""report.md (tables) and the PNG plots of a benchmark-suite run."""

from __future__ import annotations

import json
import math
from pathlib import Path

from client.bench.common import pyplot, save_figure

GOALS = {
    "branching_ttft_reduction_vs_checkpoint_agentic16k": (">=", 0.5, "0.55-0.70"),
    "branching_ttft_reduction_vs_checkpoint_sharegpt": (">=", 0.2, "0.15-0.20"),
    "checkpoint_distance_ttft_max_over_min_suffixreplay": ("<=", 1.2, "flat"),
    "capacity_throughput_ratio_vs_checkpoint": (">=", 3.0, "2.3-4.3"),
    "pcr_ttft_speedup_vs_sccache": (">=", 1.3, "-"),
    "pcr_ttft_speedup_vs_nocache": (">=", 2.0, "2.13-2.47"),
    "rag_p99_e2el_reduction_vs_lmcache_like": (">=", 0.3, "> 0.3"),
    "sim_validation_error": ("<=", 0.2, "-"),
}


# Measured beside the goals: the same comparisons for our system and the other baselines.
ALSO = {
    "branching_ttft_reduction_vs_checkpoint_agentic5k": "agentic 5K: TTFT reduction vs checkpoint",
    "checkpoint_distance_ttft_max_over_min_checkpoint": "distance sweep: checkpoint max/min",
    "checkpoint_distance_ttft_max_over_min_sglang": "distance sweep: SGLang's placement "
                                                    "max/min",
    "branching_ttft_reduction_vs_sglang_agentic16k": "agentic 16K: TTFT reduction vs SGLang's "
                                                     "placement",
    "branching_ttft_reduction_vs_sglang_agentic5k": "agentic 5K: TTFT reduction vs SGLang's "
                                                    "placement",
    "branching_ttft_reduction_vs_sglang_sharegpt": "ShareGPT: TTFT reduction vs SGLang's "
                                                   "placement",
    "distance_sweep_ttft_reduction_vs_sglang": "distance sweep: TTFT reduction vs SGLang's "
                                               "placement",
    "capacity_throughput_ratio_same_tiers_by_factor": "capacity: ours vs the checkpoint "
                                                      "baseline over the same DRAM + SSD "
                                                      "tiers (LMCache-like), by working set",
    "capacity_throughput_ratio_device_only_by_factor": "capacity: suffix replay vs the "
                                                       "checkpoint baseline, device only",
    "pcr_ttft_speedup_vs_device_only_checkpoint": "RAG: PCR TTFT speedup vs device-only "
                                                  "checkpoint",
    "ours_ttft_speedup_vs_nocache": "RAG: ours (suffix replay + PCR) TTFT speedup vs no cache",
    "rag_p99_e2el_reduction_vs_lmcache_like_ours": "RAG: ours P99 E2EL reduction vs "
                                                    "LMCache-like",
    "sim_validation_error_in_sample": "simulator error with the cost model fitted on every "
                                      "run (the goal's key is held out: each workload "
                                      "predicted from the others)",
}


def also_table(summary: dict) -> str:
    lines = ["| key | what | measured |", "| --- | --- | --- |"]
    for key, what in ALSO.items():
        if key in summary:
            lines.append(f"| `{key}` | {what} | {_fmt(summary[key])} |")
    return "\n".join(lines)


def _fmt(x, spec: str = ".3f") -> str:
    """A number as `spec`; n/a for none (null in summary.json) or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, dict):  # by working-set factor
        return ", ".join(f"{k}x {_fmt(v, spec)}" for k, v in x.items())
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _met(value, op: str, goal: float) -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):  # None too
        return "n/a"
    return "yes" if (value >= goal if op == ">=" else value <= goal) else "no"


def ratio_table(summary: dict) -> str:
    """The goal keys; beside each, its 90% bootstrap interval over the run's requests
    (`intervals.py`; "-" for the keys that get none) and what the interval says of the goal:
    met or missed by the whole interval, or the goal within it (within the run's noise)."""
    lines = ["| key | measured | 90% interval | goal | met | against the interval | paper |",
             "| --- " * 7 + "|"]
    intervals = summary.get("key_intervals") or {}
    for key, (op, goal, paper) in GOALS.items():
        v = summary.get(key, float("nan"))
        iv = intervals.get(key)
        span = f"{_fmt(iv[0])} to {_fmt(iv[1])}" if iv else "-"
        lines.append(f"| `{key}` | {_fmt(v)} | {span} | {op} {goal} | {_met(v, op, goal)} | "
                     f"{_against(iv, op, goal)} | {paper} |")
    return "\n".join(lines)


def _against(interval, op: str, goal: float) -> str:
    """"met" / "missed" when the whole interval meets / misses the goal, else "within noise";
    "-" without an interval."""
    if not interval:
        return "-"
    met = [_met(x, op, goal) == "yes" for x in interval]
    return "met" if all(met) else "missed" if not any(met) else "within noise"


def system_table(results: dict, workload: str) -> str:
    rows = results[workload]
    lines = [f"**{workload}**", "",
             "| system | TTFT mean | P50 | P95 | P99 | E2EL P99 | ITL mean | req/s | hit rate |"
             " anchors |", "| --- | " * 10 + "|"]
    lines[-1] = "| --- " * 10 + "|"
    for system, s in rows.items():
        t, e, i = s["ttft_ms"], s["e2el_ms"], s["itl_ms"]
        lines.append(f"| {system} | {_fmt(t['mean'], '.1f')} | {_fmt(t['p50'], '.1f')} | "
                     f"{_fmt(t['p95'], '.1f')} | {_fmt(t['p99'], '.1f')} | "
                     f"{_fmt(e['p99'], '.1f')} | {_fmt(i['mean'])} | "
                     f"{s['throughput_requests_per_s']:.2f} | {s['hit_rate']:.2f} | "
                     f"{s['replayed_anchors']} |")
    return "\n".join(lines)


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / (1 << 20):.1f}"


def cache_table(results: dict, workload: str) -> str:
    """What each system's cache did on `workload`: the share of prompt tokens served from
    each tier, tokens recomputed, anchors replayed, hits resumed from live states, SSD
    prefetches (started / in time before the request needed them), bytes written to SSD and
    bytes in use when the workload ended (device KV + anchors + states / DRAM / SSD files;
    servers are shared by the workloads of a family, so this includes their entries)."""
    lines = ["| system | hit device | hit DRAM | hit SSD | recomputed tokens | replayed anchors "
             "| live-state hits | prefetch started / in time | SSD MiB written "
             "| MiB in use: device / DRAM / SSD |", "| --- " * 10 + "|"]
    for system, s in results[workload].items():
        tier = s.get("hit_rate_by_tier")
        if tier is None:  # no engine counters (an old summary)
            continue
        pf = s.get("prefetch", {})
        mem = s.get("memory_bytes") or {}
        device = sum(mem.get(k, 0) for k in ("device_kv", "device_anchors", "device_states"))
        lower = " / ".join(_mib(mem[k]) if k in mem else "-" for k in ("host", "ssd"))
        in_use = f"{_mib(device)} / {lower}" if mem else "n/a"  # n/a: an older summary
        lines.append(
            f"| {system} | {tier.get('device', 0):.2f} | {tier.get('host', 0):.2f} | "
            f"{tier.get('ssd', 0):.2f} | {s.get('recomputed_tokens', 0):.0f} | "
            f"{s['replayed_anchors']} | {s.get('live_state_hits', 0):.0f} | "
            f"{pf.get('prefetch_started', 0):.0f} / {pf.get('prefetch_hits', 0):.0f} | "
            f"{_mib(s.get('ssd_bytes_written', 0))} | {in_use} |")
    return "\n".join(lines)


def _per_model_line(summary: dict, key: str, preamble: str, per_model) -> str:
    """`preamble` then `per_model(value)` for each model of the projection `summary[key]`."""
    proj = summary.get(key)
    if not proj:
        return ""
    return preamble + "; ".join(f"{model} {per_model(v)}" for model, v in proj.items())


def projection_line(summary: dict) -> str:
    """The simulator's H200 projection of PCR against SCCache (LMCache-like) on RAG."""
    return _per_model_line(
        summary, "sim_projection_h200_pcr_ttft_speedup_vs_sccache",
        "Simulator projection to an H200 (published figures, assumed; RAG queries of this "
        "run, offered load / a no-cache server's capacity): PCR TTFT speedup vs SCCache: ",
        lambda by_load: ", ".join(f"{load} {v:.2f}x" for load, v in by_load.items()))


def branch_projection_line(summary: dict) -> str:
    """The simulator's H200 projection of the branching workloads: suffix replay's branch
    TTFT reduction vs the checkpoint grid with a tight and an ample HBM budget."""
    return _per_model_line(
        summary, "sim_projection_h200_branch_ttft_reduction_vs_checkpoint",
        "Simulator projection of the branching workloads to an H200 (same assumptions; "
        "prefix cache given 1 GiB / 40 GiB of HBM): branch TTFT reduction of suffix replay "
        "vs the checkpoint grid: ",
        lambda by_wl: ", ".join(f"{wl} " + " / ".join(f"{v:.2f}" for v in by_budget.values())
                                for wl, by_budget in by_wl.items()))


def write_report(summary: dict, out: Path) -> Path:
    results = summary["results"]
    plots = plot_all(summary, out)
    parts = [f"# Benchmark suite ({'quick' if summary['quick'] else 'full'})", "",
             f"{summary['date']}, {summary['machine']}, {summary['mode']}, model "
             f"`{Path(summary['model']).name}`, k_max {summary['k_max']}, "
             f"{summary['wall_seconds']:.0f} s.", "", "## Ratios (issue 8)", "",
             ratio_table(summary), "",
             "90% interval: the key recomputed over 2000 resamples of this run's requests "
             "(`client/bench/intervals.py`; only for ratios of means). Against the interval: "
             "met or missed by all of it, or the goal within it (within this run's noise).",
             "", "Also measured:", "", also_table(summary), "",
             "Simulator validation error per run: "
             + ", ".join(f"{k} {_fmt(v, '.2f')}"
                         for k, v in summary["sim_validation_errors"].items()),
             "", projection_line(summary), "", branch_projection_line(summary), "",
             "## Per workload (times in ms)", "",
             "Each workload: latency and throughput per system, then what its cache did "
             "(hit rates are shares of the prompt tokens; MiB in use are what the server "
             "held when the workload ended, servers being shared by a family's workloads; "
             "- where a system has no such tier).", ""]
    for workload in results:
        parts += [system_table(results, workload), "", cache_table(results, workload), ""]
    parts += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def plot_all(summary: dict, out: Path) -> list[Path]:
    plt = pyplot()

    results, paths = summary["results"], []
    rag = {k: v for k, v in results.items() if k.startswith("rag_rate")}
    if rag:
        fig, ax = plt.subplots(figsize=(7, 4))
        rates = sorted(rag, key=lambda k: float(k[len("rag_rate"):]))
        for system in next(iter(rag.values())):
            ax.plot([float(k[len("rag_rate"):]) for k in rates],
                    [rag[k][system]["ttft_ms"]["mean"] for k in rates], marker="o", label=system)
        ax.set(xlabel="request rate (req/s)", ylabel="mean TTFT (ms)", yscale="log",
               title="RAG: TTFT versus request rate")
        ax.legend(fontsize=7)
        paths.append(save_figure(fig, out / "ttft_vs_rate.png"))
    sweep = results.get("distance_sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        for system, s in sweep.items():
            pts = sorted((int(t[1:]), v["p50"]) for t, v in s["ttft_ms_by_tag"].items()
                         if t.startswith("d"))
            ax.plot([d for d, _ in pts], [v for _, v in pts], marker="o", label=system)
        ax.set(xlabel="distance of the cut from the last checkpoint (tokens)",
               ylabel="median TTFT (ms)", title="TTFT versus checkpoint distance")
        ax.legend()
        paths.append(save_figure(fig, out / "ttft_vs_checkpoint_distance.png"))
    caps = {k: v for k, v in results.items() if k.startswith("capacity_")}
    if caps:
        fig, ax = plt.subplots(figsize=(7, 4))
        factors = sorted(caps, key=lambda k: int(k.split("_")[1].rstrip("x")))
        for system in next(iter(caps.values())):
            ax.plot([int(k.split("_")[1].rstrip("x")) for k in factors],
                    [caps[k][system]["throughput_requests_per_s_by_tag"]["repeat"]
                     for k in factors], marker="o", label=system)
        ax.set(xlabel="working set / device pool",
               ylabel="requests per second (repeat passes)",
               title="Throughput versus working-set size")
        ax.legend()
        paths.append(save_figure(fig, out / "throughput_vs_working_set.png"))
    cal = Path(summary["model"]) / "calibration.json"
    if cal.exists():
        sweep = json.loads(cal.read_text()).get("sweep", {})
        ks = sorted(sweep, key=int)
        if ks:
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot([int(k) for k in ks], [sweep[k]["top1_agreement"] for k in ks], marker="o",
                    label="top-1 agreement with a full prefill")
            ax2 = ax.twinx()
            ax2.plot([int(k) for k in ks], [sweep[k]["kl"] for k in ks], marker="s", color="C1",
                     label="next-token KL")
            ax.set(xscale="log", xlabel="k (anchors replayed per group)",
                   ylabel="top-1 agreement", title="Quality versus k (calibration sweep)")
            ax2.set_ylabel("KL (nats)")
            ax.legend(loc="lower right", fontsize=7)
            paths.append(save_figure(fig, out / "quality_vs_k.png"))
    return paths

