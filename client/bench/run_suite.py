"""The benchmark suite: every workload against every system in one run, then the report.

    python -m client.bench run --quick [--in-process] [--out NAME]
    python -m client.bench run --full

By default each system is served by a real tritonserver (a temporary model repository whose
hybrid_llm carries the system's parameters) and driven over gRPC; `--in-process` drives the
same engine configuration in this process. Writes client/bench/results/<out>/summary.json
(the ratio keys of issue 8 at the top), report.md (tables) and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backend.cache.config import CacheConfig
from backend.engine import Engine
from backend.model import load_model
from client.bench import sim as simulator
from client.bench import workloads as W
from client.bench.common import DEFAULT_MODEL, RESULTS_ROOT
from client.bench.intervals import CAPACITY_KEY_FACTOR, key_intervals
from client.bench.suite import (
    measure_in_process,
    reduction,
    run_in_process_interleaved,
    run_served,
    run_served_interleaved,
    summarize,
)
from client.bench.systems import (
    INTERVAL,
    SGLANG,
    SYSTEMS,
    Budget,
    bytes_per_page,
    engine_config,
    system_params,
)

# The branching workloads and the sweep also run the checkpoint baseline with SGLang's own
# placement (states per prefill chunk and at branch points, not every 256 tokens).
BRANCH_SYSTEMS = SYSTEMS + (SGLANG,)
# The quick plan leaves out the checkpoint baseline's tier ablations on the branching
# workloads: under the branching budget their working set stays on the device, so they make
# the checkpoint baseline's decisions (their tiers are measured on RAG and capacity).
QUICK_BRANCH_SYSTEMS = ("nocache", "checkpoint", SGLANG, "suffixreplay", "ours")
# ... and no cache on the 16K-token agentic tree, where every request recomputes 16K tokens
# (about a tenth of the quick run; no key uses it, agentic5k and the full plan show it).
QUICK_LONG_AGENTIC_SYSTEMS = tuple(s for s in QUICK_BRANCH_SYSTEMS if s != "nocache")
LONG_AGENTIC_TOKENS = 10_000
# Branching chat, agentic trees and the sweep: a budget under which every policy keeps the
# whole working set (the checkpoint baseline: the 16K-token tree's ~264 pages and ~69
# checkpoints need about 63 MiB), so branches compare where each policy can resume, not how much it
# can hold (that is the capacity workload's question). Generous to the baseline.
BRANCH_BUDGET = Budget(device_budget_bytes=80 << 20, host_pages=64)
# RAG as in PCR: the device holds a fraction of the documents' prefixes, DRAM and SSD the
# rest (the collection's pages are several times the device budget).
RAG_BUDGET = Budget(device_budget_bytes=2 << 20, host_pages=64)
# (No cache is left out: SGLang's placement recomputes every cut of the sweep anyway.)
SWEEP_SYSTEMS = ("checkpoint", SGLANG, "suffixreplay")
# Closed-loop workloads whose keys compare TTFTs: served interleaved across their systems.
# (Capacity stays one system after another: its tiered systems write to disk in the
# background after a request, which interleaving would hide in the next system's time.)
INTERLEAVED_KINDS = ("sharegpt", "agentic", "sweep")
# Capacity as in the papers: state checkpoints live in fixed device slots (SGLang, also with
# its KV offloaded to DRAM: pcr_dram), anchors page with their KV through every tier (ours);
# and the checkpoint baseline over the same tiers as ours (lmcache_like: its states tier
# with its pages, DRAM and SSD split between them), for the same-tiers ratio beside the key.
CAPACITY_SYSTEMS = ("checkpoint", "pcr_dram", "lmcache_like", "suffixreplay", "ours")


def plan(quick: bool) -> dict:
    if quick:
        return {"branch_systems": QUICK_BRANCH_SYSTEMS,
                "long_agentic_systems": QUICK_LONG_AGENTIC_SYSTEMS,
                # ShareGPT as in the full plan, 8 sessions x 8 turns: 20 branch requests
                # into longer histories (4 x 6 had 10; its key moved -0.19..0.25 from run
                # to run). About 100 s of the quick run.
                "sharegpt": dict(sessions=8, turns=8), "agentic": [5_000, 16_000],
                "agentic_fanout": 3, "agentic_depth": 2, "agentic_grow": 1,
                "rag": dict(num_chunks=16, num_queries=12, chunk_tokens=192),
                # The document ends two pages past the last cut (1024 + 256): each cut's
                # warm-up costs 1408 tokens, not 2048, which pays for more repeats.
                "rates": [1.5, 3.0, 6.0], "sweep_step": 64, "sweep_doc_tokens": 1408,
                # 12 repeats a cut: the key is the max / min of five per-cut medians, and a
                # cut's TTFTs spread with CV 0.15-0.20 on this host (a bare matrix-product
                # loop varies as much), so eight repeats read up to 1.22 on a flat cost
                # (16 read 1.06 and 1.15 but took the quick run to 522-561 s).
                "sweep_base": 1024, "sweep_repeats": 12,
                # Capacity: four repeat passes (32 requests; one pass of 8 moved the key
                # 2.0-4.7 from run to run, two 2.0-3.6).
                "capacity": [4], "capacity_passes": 5, "capacity_doc_tokens": 1024}
    return {"sharegpt": dict(sessions=8, turns=8), "agentic": [5_000, 16_000],
            "agentic_fanout": 3, "agentic_depth": 2, "agentic_grow": 3,
            "rag": dict(num_chunks=96, num_queries=48),
            "rates": [0.5, 1.0, 2.0, 4.0, 8.0], "sweep_step": 32, "sweep_doc_tokens": 1408,
            "sweep_base": 1024, "sweep_repeats": 16,
            "capacity": [2, 4, 6, 8], "capacity_passes": 5, "capacity_doc_tokens": 1024}


def k_max_of(model_dir: Path) -> int:
    cal = model_dir / "calibration.json"
    return int(json.loads(cal.read_text())["k_max"]) if cal.exists() else 64


class Runner:
    def __init__(self, model_dir: Path, in_process: bool, budget: Budget, work: Path) -> None:
        self.in_process = in_process
        self.budget, self.work = budget, work
        self.model = load_model(model_dir)
        self.cfg = self.model.config
        self.k_max = k_max_of(model_dir)
        self.records: dict[str, list] = {}
        # Warm-up (lazy initialisation, allocator) so the first system measured is not charged.
        warm = _warmup()
        measure_in_process(self.model, engine_config("suffixreplay", self.cfg, budget,
                                                     self.k_max), warm)

    def run_system(self, system: str, workloads: list[W.Workload], budget: Budget,
                   progress) -> dict[str, dict]:
        """All `workloads` on one system. In-process: a fresh engine per workload. Served: one
        server per system and budget (each workload has its own cache-salt namespace:
        `build_jobs`)."""
        out: dict[str, dict] = {}
        ssd = Path(tempfile.mkdtemp(dir=self.work, prefix=f"{system}-"))
        if self.in_process:
            for wl in workloads:
                config = engine_config(system, self.cfg, budget, self.k_max,
                                       Path(tempfile.mkdtemp(dir=ssd)))
                out[wl.name], self.records[f"{wl.name}/{system}"] = measure_in_process(
                    self.model, config, wl)
                progress(wl.name, (system,), {wl.name: {system: out[wl.name]}})
            return out
        from client.bench.serving import served_repository

        # Each server shuts down while the next one starts (never while one measures).
        with served_repository(system_params(system, self.cfg, budget, self.k_max, ssd),
                               stop_in_background=True) as srv:
            # One unmeasured request first (its own namespace): the server's first forward
            # pays lazy initialisation, which would land on one system's first measurement.
            run_served(srv.urls.grpc, _warmup())
            for wl in workloads:
                before = _counters(srv.urls.metrics)
                t0 = time.perf_counter()
                records = run_served(srv.urls.grpc, wl)
                elapsed = time.perf_counter() - t0  # (before the scrape: it waits 0.3 s)
                out[wl.name] = summarize(records, _metrics_delta(before, _counters(
                    srv.urls.metrics)), elapsed)
                self.records[f"{wl.name}/{system}"] = [_record_row(r) for r in records]
                progress(wl.name, (system,), {wl.name: {system: out[wl.name]}})
        return out

    def run_interleaved(self, jobs: list[tuple[W.Workload, tuple[str, ...]]], budget: Budget,
                        progress) -> dict[str, dict[str, dict]]:
        """Closed-loop workloads on one server (or in-process engine) per system, all serving
        at once; each request goes to every system of its workload before the next request
        goes to any (`run_served_interleaved`), so host noise lands on every system alike.
        Returns {workload: {system: summary}}."""
        from contextlib import ExitStack

        from client.bench.serving import served_repository

        systems = list(dict.fromkeys(s for _, ss in jobs for s in ss))
        out: dict[str, dict[str, dict]] = {}
        if self.in_process:  # fresh engines per workload, as `run_system` has them
            for wl, wl_systems in jobs:
                engines = {}
                for system in wl_systems:
                    ssd = Path(tempfile.mkdtemp(dir=self.work, prefix=f"{system}-"))
                    engines[system] = Engine(self.model, engine_config(
                        system, self.cfg, budget, self.k_max, ssd))
                records = run_in_process_interleaved(engines, wl)
                for engine in engines.values():
                    engine.store.assert_invariants()
                out[wl.name] = self._keep(wl, records,
                                          {s: e.stats() for s, e in engines.items()})
                progress(wl.name, wl_systems, {wl.name: out[wl.name]})
            return out
        with ExitStack() as stack:
            urls = {}
            for system in systems:
                ssd = Path(tempfile.mkdtemp(dir=self.work, prefix=f"{system}-"))
                srv = stack.enter_context(served_repository(
                    system_params(system, self.cfg, budget, self.k_max, ssd),
                    stop_in_background=True))
                run_served(srv.urls.grpc, _warmup())
                urls[system] = srv.urls
            for wl, wl_systems in jobs:
                before = {s: _counters(urls[s].metrics) for s in wl_systems}
                records = run_served_interleaved({s: urls[s].grpc for s in wl_systems}, wl)
                out[wl.name] = self._keep(wl, records, {
                    s: _metrics_delta(before[s], _counters(urls[s].metrics))
                    for s in wl_systems})
                progress(wl.name, wl_systems, {wl.name: out[wl.name]})
        return out

    def _keep(self, wl: W.Workload, records: dict[str, list], stats: dict[str, dict]) -> dict:
        """Summaries (and records) of one interleaved workload, per system. Each system's
        time is the sum of its own (sequential) requests."""
        out = {}
        for system, recs in records.items():
            busy = sum(r.e2el for r in recs)
            out[system] = summarize(recs, stats[system], busy, busy_spans=True)
            self.records[f"{wl.name}/{system}"] = [_record_row(r) for r in recs]
        return out


def _record_row(r) -> dict:
    return {"rid": r.rid, "tag": r.tag, "prompt_tokens": r.prompt_tokens, "ttft": r.ttft,
            "e2el": r.e2el, "cached_tokens": r.cached_tokens,
            "replayed_anchors": r.replayed_anchors, "output_tokens": r.output_tokens,
            "error": r.error}


def _warmup() -> W.Workload:
    """One short unmeasured request in its own cache namespace."""
    return W.Workload("warmup", [W.BenchRequest("w", list(b"def f(x):\n" * 40), 4,
                                                salt="warmup")])


def _counters(url: str) -> dict:
    """The served engine's counters (Prometheus, suffixreplay_*), metrics settle first."""
    from client.metrics import scrape

    time.sleep(0.3)  # the metrics thread samples engine.stats() every 100 ms
    return {k: v for k, v in scrape(url).items() if k[0].startswith("suffixreplay_")}


def _metrics_delta(before: dict, after: dict) -> dict:
    """engine.stats()-shaped counters of one workload, from two scrapes."""
    from client.metrics import by_label, total

    # Labels are matched as a subset: the served model's (model, version) come beside ours.
    def gauge(name: str, **labels) -> float:
        return total(after, name, **labels) or 0.0

    def delta(name: str, **labels) -> float:
        return gauge(name, **labels) - (total(before, name, **labels) or 0.0)

    tiers = ("device", "host", "ssd")
    return {
        "cache": {"hit_tokens_by_tier": {t: delta("suffixreplay_hit_tokens_total", tier=t)
                                         for t in tiers}},
        "tiers": {"prefetch_hits": delta("suffixreplay_prefetch_total", result="hit"),
                  "prefetch_late": delta("suffixreplay_prefetch_total", result="late"),
                  "prefetch_started": delta("suffixreplay_prefetch_started_total"),
                  "ssd_bytes_written": delta("suffixreplay_ssd_bytes_total", direction="written"),
                  "deferred_admissions": delta("suffixreplay_deferred_admissions_total")},
        "recomputed_tokens": delta("suffixreplay_recomputed_tokens_total"),
        "live_state_hits": delta("suffixreplay_live_state_hits_total"),
        "cached_pages": gauge("suffixreplay_kv_pages", state="cached"),
        "memory_bytes": by_label(after, "suffixreplay_memory_bytes", "pool"),
    }


def _mean_ttft(s: dict, tag: str | None = None) -> float:
    d = s["ttft_ms_by_tag"].get(tag, {}) if tag else s["ttft_ms"]
    return d.get("mean", float("nan"))


def _mean_over_cuts(s: dict) -> float:
    """Mean TTFT of the sweep's cut requests (tags d0, d64, ...; each cut as often)."""
    means = [v["mean"] for t, v in s["ttft_ms_by_tag"].items() if t.startswith("d")]
    return sum(means) / len(means) if means else float("nan")


def _dump(path: Path, obj) -> None:
    """JSON without NaN (not JSON: jq, browsers and most parsers reject it): null instead."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(obj), indent=2, default=float, allow_nan=False) + "\n")


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(2)
    p = plan(not args.full)
    name = args.out or time.strftime(f"suite_{'full' if args.full else 'quick'}_%m%d_%H%M")
    out = RESULTS_ROOT / name
    if (out / "summary.json").exists() and not args.force:
        raise SystemExit(f"{out} holds a finished run: pass another --out, or --force to "
                         "replace it")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    runner = Runner(Path(args.model), args.in_process, BRANCH_BUDGET, work)
    results: dict[str, dict] = {}
    jobs = build_jobs(p, runner)
    # The branching workloads and the sweep (closed loop, TTFT keys) run interleaved across
    # their systems (servers, or engines in-process); the rest one system after another.
    interleaved: dict[Budget, list] = {}
    groups: dict[tuple[str, Budget], list[W.Workload]] = {}
    for kind, workload, systems, budget in jobs:
        if kind in INTERLEAVED_KINDS:
            interleaved.setdefault(budget, []).append((workload, systems))
            continue
        for system in systems:
            groups.setdefault((system, budget), []).append(workload)
    total = sum(len(v) for v in groups.values()) + sum(
        len(systems) for v in interleaved.values() for _, systems in v)
    bar = tqdm(total=total, desc="bench suite", unit="run")

    t0 = time.time()

    def progress(workload: str, systems: tuple[str, ...], done: dict) -> None:
        """After each finished run: its results, and what has finished so far on disk
        (partial.json, records.json), so an interrupted run keeps its measurements."""
        for wl_name, by_system in done.items():
            results.setdefault(wl_name, {}).update(by_system)
        bar.set_postfix(done=f"{workload}/{'+'.join(systems)}")
        bar.update(len(systems))
        _dump(out / "partial.json", {"date": time.strftime("%Y-%m-%d %H:%M"),
                                     "wall_seconds": round(time.time() - t0, 1),
                                     "results": results})
        _dump(out / "records.json", runner.records)

    try:
        for budget, wl_jobs in interleaved.items():
            runner.run_interleaved(wl_jobs, budget, progress)
        for (system, budget), workloads in groups.items():
            runner.run_system(system, workloads, budget, progress)
    finally:
        if not args.in_process:
            from client.bench.serving import wait_for_stopped_servers

            wait_for_stopped_servers()
        # The systems' SSD tiers (up to a few GiB a run): nothing in them outlives the run.
        shutil.rmtree(work, ignore_errors=True)
        if not any(out.iterdir()):  # interrupted before any run finished
            out.rmdir()
    bar.close()
    summary = ratios(results, p)
    summary["key_intervals"] = key_intervals(runner.records, summary)
    summary.update(simulation(runner, jobs, results))
    summary.update({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": "2-core CPU, no GPU",
                    "plan": p,
                    "mode": "in-process" if args.in_process else "tritonserver (gRPC)",
                    "quick": not args.full, "model": str(args.model), "k_max": runner.k_max,
                    "wall_seconds": round(time.time() - t0, 1), "results": results})
    _dump(out / "summary.json", summary)
    _dump(out / "records.json", runner.records)
    (out / "partial.json").unlink(missing_ok=True)
    from client.bench.report import write_report

    write_report(summary, out)
    print(f"wrote {out}/summary.json, report.md and plots")
    return summary


def build_jobs(p: dict, runner) -> list[tuple[str, W.Workload, tuple[str, ...], Budget]]:
    """(kind, workload, systems, budget) of every run of the plan (deterministic)."""
    jobs: list = []
    branch = p.get("branch_systems", BRANCH_SYSTEMS)
    jobs += [(s, W.sharegpt(**p["sharegpt"]), branch, None) for s in ["sharegpt"]]
    for n in p["agentic"]:
        systems = p.get("long_agentic_systems", branch) if n >= LONG_AGENTIC_TOKENS else branch
        jobs.append(("agentic", W.agentic(n, fanout=p["agentic_fanout"],
                                          depth=p["agentic_depth"], grow=p["agentic_grow"]),
                     systems, None))
    corpus = W.rag_corpus(**p["rag"])
    for rate in p["rates"]:
        jobs.append(("rag", W.rag(corpus, rate), SYSTEMS, RAG_BUDGET))
    # Each cut several times: the key is a ratio of per-cut medians of ~50 ms hits.
    jobs.append(("sweep", W.distance_sweep(doc_tokens=p["sweep_doc_tokens"],
                                           base=p.get("sweep_base"), step=p["sweep_step"],
                                           repeats=p["sweep_repeats"]),
                 SWEEP_SYSTEMS, None))
    cap_budget = Budget(device_budget_bytes=4 << 20, host_pages=64)
    pool_tokens = cap_budget.device_budget_bytes // (bytes_per_page(runner.cfg, 64) // 64)
    for f in p["capacity"]:
        jobs.append(("capacity", W.capacity(pool_tokens, f, passes=p["capacity_passes"],
                                            doc_tokens=p["capacity_doc_tokens"]),
                     CAPACITY_SYSTEMS, cap_budget))
    # Room for running requests per family of workloads (one served engine per family and
    # system): branching chat, agentic trees and the sweep (closed loop, each cut in its own
    # namespace) share one; RAG and capacity, with their smaller device budgets, have their
    # own.
    family = {"sharegpt": "branch", "agentic": "branch", "sweep": "branch"}
    need: dict[str, Budget] = {}
    for kind, wl, _, budget in jobs:
        b = _with_run_pages(budget or runner.budget, wl)
        key = family.get(kind, kind)
        if key not in need or b.run_pages > need[key].run_pages:
            need[key] = b
    jobs = [(kind, wl, systems, need[family.get(kind, kind)]) for kind, wl, systems, _ in jobs]
    # Each workload in its own cache-salt namespace (servers are shared across workloads).
    for _, wl, _, _ in jobs:
        for req in wl.requests:
            req.salt = f"{wl.name}/{req.salt}"
    return jobs


def _with_run_pages(budget: Budget, workload: W.Workload) -> Budget:
    """Room for the running requests outside the cache budget: the longest prompt (plus its
    output) of the workload, for each request that may run at once."""
    from dataclasses import replace

    longest = max(len(r.prompt) + r.max_tokens for r in workload.requests)
    concurrent = 1 if all(r.arrival is None for r in workload.requests) else budget.max_num_seqs
    return replace(budget, run_pages=concurrent * (-(-longest // budget.page_size) + 1))


def ratios(results: dict, p: dict) -> dict:
    r: dict = {}
    for name, key in (("agentic16k", "branching_ttft_reduction_vs_checkpoint_agentic16k"),
                      ("agentic5k", "branching_ttft_reduction_vs_checkpoint_agentic5k"),
                      ("sharegpt", "branching_ttft_reduction_vs_checkpoint_sharegpt")):
        if name in results:
            res = results[name]
            r[key] = reduction(_mean_ttft(res["suffixreplay"], "branch"),
                                _mean_ttft(res["checkpoint"], "branch"))
            if SGLANG in res:
                r[f"branching_ttft_reduction_vs_sglang_{name}"] = reduction(
                    _mean_ttft(res["suffixreplay"], "branch"), _mean_ttft(res[SGLANG], "branch"))
    sweep = results.get("distance_sweep")
    if sweep:
        for system in ("suffixreplay", "checkpoint", SGLANG):
            if system not in sweep:
                continue
            ttfts = [v["p50"] for t, v in sweep[system]["ttft_ms_by_tag"].items()
                     if t.startswith("d")]
            key = f"checkpoint_distance_ttft_max_over_min_{system}"
            r[key] = max(ttfts) / min(ttfts)
        if SGLANG in sweep:  # SGLang keeps no state inside the document: every cut recomputes
            # Over the cuts only: the warm-up requests (the whole document, uncached in its
            # fresh namespace) cost every system the same.
            r["distance_sweep_ttft_reduction_vs_sglang"] = reduction(
                _mean_over_cuts(sweep["suffixreplay"]), _mean_over_cuts(sweep[SGLANG]))
    caps = {int(k.split("_")[1].rstrip("x")): v for k, v in results.items()
            if k.startswith("capacity_")}

    def steady(summary: dict) -> float:  # requests/s over the repeat passes
        return summary["throughput_requests_per_s_by_tag"]["repeat"]

    # Ours against the better of the two checkpoint systems, both at steady state.
    ratios_by_factor = {f: steady(v["ours"]) / max(steady(v["checkpoint"]),
                                                   steady(v["pcr_dram"]))
                        for f, v in caps.items()}
    r["capacity_throughput_ratio_by_factor"] = ratios_by_factor
    r["capacity_throughput_ratio_device_only_by_factor"] = {
        f: steady(v["suffixreplay"]) / steady(v["checkpoint"]) for f, v in caps.items()}
    r["capacity_throughput_ratio_same_tiers_by_factor"] = {
        f: steady(v["ours"]) / steady(v["lmcache_like"]) for f, v in caps.items()
        if "lmcache_like" in v}
    at4 = [v for f, v in ratios_by_factor.items() if f >= CAPACITY_KEY_FACTOR]
    r["capacity_throughput_ratio_vs_checkpoint"] = min(at4) if at4 else float("nan")
    rates = p["rates"]
    moderate = f"rag_rate{rates[len(rates) // 2]:g}" if rates else None
    if moderate in results:
        rag = results[moderate]
        # SCCache as in the PCR paper: DRAM + SSD tiers, no overlap, no prefetch (and no
        # look-ahead): lmcache_like. The device-only checkpoint system is reported beside it.
        r["pcr_ttft_speedup_vs_sccache"] = _mean_ttft(rag["lmcache_like"]) / _mean_ttft(
            rag["pcr_full"])
        r["pcr_ttft_speedup_vs_device_only_checkpoint"] = _mean_ttft(
            rag["checkpoint"]) / _mean_ttft(rag["pcr_full"])
        r["ours_ttft_speedup_vs_nocache"] = _mean_ttft(rag["nocache"]) / _mean_ttft(rag["ours"])
        r["pcr_ttft_speedup_vs_nocache"] = _mean_ttft(rag["nocache"]) / _mean_ttft(
            rag["pcr_full"])
        r["rag_p99_e2el_reduction_vs_lmcache_like"] = reduction(
            rag["pcr_full"]["e2el_ms"]["p99"], rag["lmcache_like"]["e2el_ms"]["p99"])
        r["rag_p99_e2el_reduction_vs_lmcache_like_ours"] = reduction(
            rag["ours"]["e2el_ms"]["p99"], rag["lmcache_like"]["e2el_ms"]["p99"])
        r["rag_moderate_rate"] = rates[len(rates) // 2]
    return r


def fit_rows(records: dict[str, list[dict]], groups: int) -> dict[str, list[dict]]:
    """The cost model's rows (`CostModel.fit`) of a run's closed-loop records, by workload:
    RAG's left out (queueing is not in the cost model), failed requests too; anchors in
    `simulate`'s unit (the engine counts k a replay, which runs through each of the `groups`)."""
    rows: dict[str, list[dict]] = {}
    for key, recs in records.items():
        if key.startswith("rag"):
            continue
        for rec in recs:
            if rec.get("error"):
                continue
            rows.setdefault(key.split("/")[0], []).append({
                "recomputed": rec["prompt_tokens"] - rec["cached_tokens"],
                "context": rec["prompt_tokens"], "anchors": rec["replayed_anchors"] * groups,
                "ttft": rec["ttft"], "e2el": rec["e2el"], "output_tokens": rec["output_tokens"]})
    return rows


def simulation(runner, jobs, results: dict) -> dict:
    """Fits the cost model on the closed-loop runs, validates the simulator against them and
    projects to real model shapes on an H200 (stated assumptions). Validation is held out:
    each workload is predicted by a cost model fitted on the other workloads' runs (the
    in-sample error, fitted on all, is reported beside it)."""
    from backend.cache.accounting import CONFIG_DIR
    from backend.config import ModelConfig

    shapes = simulator.shapes_of(runner.cfg, dtype_bytes=4, k_max=runner.k_max)
    rows = fit_rows(runner.records, shapes.groups)
    if not rows:
        return {"sim_validation_error": float("nan"), "sim_validation_errors": {},
                "sim_note": "no closed-loop request finished: nothing to fit the cost model on"}
    cost = simulator.CostModel.fit([r for rs in rows.values() for r in rs])
    errors, in_sample = {}, {}
    for _, workload, systems, budget in jobs:
        if workload.name.startswith("rag"):
            continue
        others = [r for name, rs in rows.items() if name != workload.name for r in rs]
        held_out = simulator.CostModel.fit(others) if others else None
        for system in systems:
            if system not in ("nocache", "checkpoint", "suffixreplay"):
                continue
            sim_sys = simulator.system_of(engine_config(system, runner.cfg, budget,
                                                        runner.k_max), shapes)
            meas = results[workload.name][system]["ttft_ms"]["mean"]
            key = f"{workload.name}/{system}"
            for model, into in ((cost, in_sample), (held_out, errors)):
                if model is not None:
                    pred = simulator.simulate(workload, sim_sys, shapes, model)["ttft_mean_s"]
                    into[key] = abs(pred * 1000 - meas) / meas
    projection, pcr_vs_sccache, branch_reduction = {}, {}, {}
    # The papers' replay caps: k_max 512 for Qwen3.5-4B, 256 for Qwen3.6-27B; Nemotron-H-8B
    # (the second family: 24 Mamba2 layers with 4 MiB states, 4 attention layers) at 512, an
    # assumption (the paper has no figure for it; a group's share of the layers stands for its
    # share of the compute: 7 of 52 layers, ~12% of the parameters).
    for name, params_b, k_max in (("qwen3_5_4b", 4.0, 512), ("qwen3_6_27b", 27.0, 256),
                                  ("nemotron_h_8b", 8.0, 512)):
        cfg = ModelConfig.from_file(CONFIG_DIR / f"{name}.json")
        gpu = simulator.CostModel.h200(params_b, len(cfg.attention_layer_ids),
                                       cfg.num_attention_heads, cfg.head_dim,
                                       len(cfg.groups[0]) / cfg.num_hidden_layers)
        sh = simulator.shapes_of(cfg, dtype_bytes=2, k_max=k_max)
        proj = {}
        for _, workload, _, _ in jobs:
            if not workload.name.startswith(("agentic", "sharegpt")):
                continue
            for gib in (1, 40):  # prefix-cache budget in HBM
                for policy in ("none", "checkpoint", "suffixreplay"):
                    # Suffix replay with the engine's default 16 live-state slots.
                    system = simulator.SimSystem(policy, gib << 30, live_slots=PROJECTION_LIVE)
                    s = simulator.simulate(workload, system, sh, gpu)
                    proj.setdefault(workload.name, {})[f"{policy}@{gib}GiB"] = s
        rag = next((wl for _, wl, _, _ in jobs if wl.name.startswith("rag")), None)
        if rag is not None:
            proj["rag"] = rag_projection(rag, sh, gpu)
            pcr_vs_sccache[name] = {u: v["lmcache_like"]["ttft_mean_s"]
                                    / v["pcr_full"]["ttft_mean_s"]
                                    for u, v in proj["rag"].items()}
        projection[name] = proj
        branch_reduction[name] = _branch_reduction(proj)
    def mean(d: dict) -> float:
        return sum(d.values()) / len(d) if d else float("nan")

    return {"sim_validation_error": mean(errors), "sim_validation_errors": errors,
            "sim_validation_error_in_sample": mean(in_sample),
            "sim_cost_model": cost.__dict__, "sim_projection_h200": projection,
            "sim_projection_h200_pcr_ttft_speedup_vs_sccache": pcr_vs_sccache,
            "sim_projection_h200_branch_ttft_reduction_vs_checkpoint": branch_reduction}


def _branch_reduction(proj: dict) -> dict:
    """{workload: {budget: branch requests' TTFT reduction of suffix replay vs the checkpoint
    grid}} from one model's projection (HBM budgets of 1 and 40 GiB for the prefix cache)."""
    out = {}
    for workload, systems in proj.items():
        for gib in (1, 40):
            ckpt = systems.get(f"checkpoint@{gib}GiB", {}).get("ttft_by_tag_s", {}).get("branch")
            ours = systems.get(f"suffixreplay@{gib}GiB", {}).get("ttft_by_tag_s", {}).get(
                "branch")
            if ckpt and ours is not None:
                out.setdefault(workload, {})[f"{gib}GiB"] = 1 - ours / ckpt
    return out


# The RAG projection: the run's queries at these loads (offered load / a no-cache server's
# capacity), the tiers sized from the queries' distinct prefix pages as the measured RAG
# budget sizes them (device 1/8, DRAM 1/2 of them, SSD all), checkpoint states as the
# measured tiered systems keep them.
PROJECTION_LIVE = CacheConfig().num_checkpoint_slots
RAG_PROJECTION_LOADS = (0.5, 0.8, 0.95)
RAG_PROJECTION_SYSTEMS = {"lmcache_like": (False, False), "pcr_overlap": (True, False),
                          "pcr_full": (True, True)}  # (overlap, prefetch)


def rag_projection(workload: W.Workload, shapes, cost) -> dict:
    from dataclasses import replace

    pages = {k for r in workload.requests
             for k in simulator.page_keys(r.prompt, shapes.page_size, r.salt)}
    closed = W.Workload(workload.name, [replace(r, arrival=None) for r in workload.requests])
    service = simulator.simulate(closed, simulator.SimSystem("none", 0), shapes,
                                 cost)["ttft_mean_s"]
    rate = workload.params["rate"]
    out = {}
    for load in RAG_PROJECTION_LOADS:
        scale = rate / (load / service)  # arrival times at the new rate
        wl = W.Workload(workload.name, [replace(r, arrival=r.arrival * scale)
                                        for r in workload.requests])
        out[f"load{load:g}"] = {
            name: simulator.simulate(wl, simulator.SimSystem(
                "checkpoint", len(pages) // 8 * shapes.kv_page, len(pages) // 2 * shapes.kv_page,
                INTERVAL, ssd_bytes=4 * len(pages) * shapes.kv_page, overlap=overlap,
                prefetch=prefetch), shapes, cost)
            for name, (overlap, prefetch) in RAG_PROJECTION_SYSTEMS.items()}
    return out


def resimulate(out: Path, model_dir: Path | None = None, full: bool | None = None) -> dict:
    """Recomputes the ratio keys, their intervals, the simulator part and report.md of a
    finished run from its results and records (no engine runs), with the plan the run
    stored (runs before it was stored: the current plan of their kind, or `full`'s).
    model_dir: the run's model (default: the one the run names, if it is here; else the
    default model)."""
    from types import SimpleNamespace

    from backend.config import ModelConfig

    summary = json.loads((out / "summary.json").read_text())
    if model_dir is None:
        named = Path(summary.get("model", ""))
        model_dir = named if (named / "config.json").exists() else Path(DEFAULT_MODEL)
    if full is None:
        full = summary.get("quick") is False
    p = summary.get("plan") or plan(not full)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    runner = SimpleNamespace(cfg=cfg, k_max=summary["k_max"], budget=BRANCH_BUDGET,
                             records=json.loads((out / "records.json").read_text()))
    jobs = build_jobs(p, runner)
    summary.update(ratios(summary["results"], p))
    summary["key_intervals"] = key_intervals(runner.records, summary)
    summary.update(simulation(runner, jobs, summary["results"]))
    _dump(out / "summary.json", summary)
    from client.bench.report import write_report

    write_report(summary, out)
    return summary


def report_main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m client.bench report",
        description="Recompute a finished suite run's keys, intervals, simulator and report.md "
                    "from its summary.json and records.json (no engine runs).")
    p.add_argument("run", help="the run's folder, or its name under client/bench/results/")
    p.add_argument("--model", help="the run's model folder (default: the one the run names)")
    args = p.parse_args(argv)
    if args.model:
        _check_model_arg(p, args.model)
    out = Path(args.run)
    if not (out / "summary.json").exists():
        out = RESULTS_ROOT / args.run
    if not (out / "summary.json").exists() or not (out / "records.json").exists():
        raise SystemExit(f"{args.run}: no finished run there (summary.json and records.json)")
    summary = resimulate(out, Path(args.model) if args.model else None)
    print(f"rewrote {out}/summary.json, report.md and plots")
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m client.bench run", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="all workloads, small (default)")
    mode.add_argument("--full", action="store_true")
    p.add_argument("--in-process", action="store_true", help="no server: drive the engine here")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--out", help="folder under client/bench/results/ (default: "
                   "suite_quick_MMDD_HHMM or suite_full_MMDD_HHMM)")
    p.add_argument("--force", action="store_true",
                   help="replace a finished run already in --out")
    args = p.parse_args(argv)
    _check_model_arg(p, args.model)
    return run(args)


def _check_model_arg(p: argparse.ArgumentParser, model: str) -> None:
    """A usage error (exit 2) unless `model` is a checkpoint folder whose configuration the
    engine reads (a bad --model failed with a traceback, `run` after making its folder)."""
    from backend.config import ModelConfig

    config = Path(model) / "config.json"
    if not config.is_file():
        p.error(f"--model {model}: no model folder (config.json) there")
    try:
        ModelConfig.from_file(config)
    except (ValueError, OSError) as e:
        p.error(f"--model {model}: {e}")
