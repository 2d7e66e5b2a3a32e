"""Runs workloads against systems and measures them (in-process engine or the Triton server).

`run_in_process` drives an `Engine` thread exactly as the Triton model does (submit with an
output callback): closed-loop requests start when the previous one finished, open-loop ones at
their arrival time. `run_served` sends the same requests to a real tritonserver over gRPC
streaming (one server per system, its hybrid_llm configured like the in-process engine).
Both record per request: TTFT, end-to-end latency, inter-token latencies, cached prompt tokens.
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

from backend.engine import Engine, EngineConfig, Request, SamplingParams
from client.bench.workloads import BenchRequest, Workload, text_of


@dataclass
class Record:
    rid: str
    tag: str
    prompt_tokens: int
    submitted: float = 0.0
    first: float | None = None
    last: float | None = None
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    replayed_anchors: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return (self.first or self.submitted) - self.submitted

    @property
    def e2el(self) -> float:
        return (self.last or self.submitted) - self.submitted

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def take(self, out, now: float) -> bool:
        """Records one engine output (`RequestOutput`) seen at `now`; True once finished."""
        if out.new_token_ids:
            self.first = self.first or now
            self.token_times += [now] * len(out.new_token_ids)
            self.output_tokens += len(out.new_token_ids)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.replayed_anchors = max(self.replayed_anchors, out.replayed_anchors)
        if out.finished:
            self.last = now
            if out.finish_reason == "error":
                self.error = "error"
        return out.finished


def reduction(ours: float, base: float) -> float:
    """1 - ours / base: the share of `base` that `ours` saves (NaN without a base)."""
    return 1 - ours / base if base and not math.isnan(base) else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, float]:
    """Mean, P50, P95, P99 in milliseconds."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"),
                "p99": float("nan"), "n": 0}
    ms = [v * 1000 for v in values]
    return {"mean": statistics.fmean(ms), "p50": percentile(ms, 50), "p95": percentile(ms, 95),
            "p99": percentile(ms, 99), "n": len(ms)}


def _sampling(req: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.max_tokens, min_tokens=req.max_tokens, top_k=1)


def run_in_process(engine: Engine, workload: Workload, timeout_s: float = 600.0) -> list[Record]:
    records: dict[str, Record] = {}
    done: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def on_output(out) -> None:
        now = time.perf_counter()
        with lock:
            if records[out.request_id].take(out, now):
                done[out.request_id].set()

    engine.start()
    t0 = time.perf_counter()
    previous: threading.Event | None = None
    try:
        for req in workload.requests:
            if req.arrival is None:
                if previous is not None and not previous.wait(timeout_s):
                    raise TimeoutError(f"{workload.name}: request before {req.rid} hung")
            else:
                delay = t0 + req.arrival - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            rec = Record(req.rid, req.tag, len(req.prompt), submitted=time.perf_counter())
            with lock:
                records[req.rid] = rec
                done[req.rid] = previous = threading.Event()
            engine.submit(Request(req.rid, list(req.prompt), _sampling(req),
                                  cache_salt=req.salt, on_output=on_output))
        for rid, ev in done.items():
            if not ev.wait(timeout_s):
                raise TimeoutError(f"{workload.name}: request {rid} did not finish")
    finally:
        engine.stop()
    return list(records.values())


def _interleave(systems: list[str], workload: Workload, send) -> dict[str, list[Record]]:
    """Request i of a closed-loop workload goes to every system (in an order that rotates
    with i) before request i + 1 goes to any; `send(system, req, rec)` runs one request to
    its end. Each system still sees the workload's requests in order, one at a time, and the
    systems' measurements of one request lie seconds apart, so a noisy host moves them
    together."""
    if any(r.arrival is not None for r in workload.requests):
        raise ValueError(f"{workload.name}: interleaving needs a closed-loop workload")
    records: dict[str, list[Record]] = {s: [] for s in systems}
    for i, req in enumerate(workload.requests):
        k = i % len(systems)
        for system in systems[k:] + systems[:k]:
            rec = Record(req.rid, req.tag, len(req.prompt), submitted=time.perf_counter())
            records[system].append(rec)
            send(system, req, rec)
    return records


def run_in_process_interleaved(engines: dict[str, Engine], workload: Workload,
                               timeout_s: float = 600.0) -> dict[str, list[Record]]:
    """`_interleave` over in-process engines (each on its own thread, sharing the model's
    weights)."""

    def send(system: str, req: BenchRequest, rec: Record) -> None:
        done = threading.Event()

        def on_output(out) -> None:
            if rec.take(out, time.perf_counter()):
                done.set()

        engines[system].submit(Request(f"{system}/{req.rid}", list(req.prompt), _sampling(req),
                                       cache_salt=req.salt, on_output=on_output))
        if not done.wait(timeout_s):
            raise TimeoutError(f"{workload.name}: {req.rid} on {system} hung")

    for engine in engines.values():
        engine.start()
    try:
        return _interleave(list(engines), workload, send)
    finally:
        for engine in engines.values():
            engine.stop()


def _send(grpc_url: str, req: BenchRequest, rec: Record) -> None:
    """One request through tritonserver (gRPC streaming, ensemble), recorded into `rec`."""
    from client.generate import GenerateParams, stream_grpc

    text = text_of(req.prompt)  # the server's tokenizer gives back req.prompt (tested)
    params = GenerateParams(text, max_tokens=req.max_tokens, min_tokens=req.max_tokens,
                            top_k=1, cache_salt=req.salt)
    try:
        for chunk in stream_grpc(grpc_url, params):
            now = time.perf_counter()
            rec.first = rec.first or now
            rec.token_times.append(now)
            rec.output_tokens += chunk.counts.get("num_output_tokens", 1)
            rec.cached_tokens = max(rec.cached_tokens, chunk.counts.get("cached_tokens", 0))
            rec.replayed_anchors = max(rec.replayed_anchors,
                                       chunk.counts.get("replayed_anchors", 0))
    except Exception as e:  # the record shows the failure; the run goes on
        rec.error = str(e)
    rec.last = time.perf_counter()


def run_served_interleaved(grpc_urls: dict[str, str], workload: Workload) -> dict[str, list]:
    """`_interleave` over several servers at once (one per system)."""
    return _interleave(list(grpc_urls), workload,
                       lambda system, req, rec: _send(grpc_urls[system], req, rec))


def run_served(grpc_url: str, workload: Workload, timeout_s: float = 600.0) -> list[Record]:
    """The same workload through tritonserver (gRPC streaming, ensemble), one thread per
    open-loop request."""
    records: list[Record] = []
    threads: list[threading.Thread] = []
    one = functools.partial(_send, grpc_url)
    t0 = time.perf_counter()
    for req in workload.requests:
        if req.arrival is not None:
            delay = t0 + req.arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        rec = Record(req.rid, req.tag, len(req.prompt), submitted=time.perf_counter())
        records.append(rec)
        if req.arrival is None:
            one(req, rec)
        else:
            th = threading.Thread(target=one, args=(req, rec), daemon=True)
            th.start()
            threads.append(th)
    for th in threads:
        th.join(timeout_s)
    return records


def _span(records: list[Record]) -> float:
    return max(r.last or r.submitted for r in records) - min(r.submitted for r in records)


def summarize(records: list[Record], engine_stats: dict | None, makespan: float,
              busy_spans: bool = False) -> dict:
    """busy_spans: per-tag spans are the sum of the tag's request times (closed-loop records
    interleaved with other systems' requests), not first submission to last token."""
    ok = [r for r in records if r.error is None]
    by_tag: dict[str, list[Record]] = {}
    for r in ok:
        by_tag.setdefault(r.tag, []).append(r)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "requests": len(records), "errors": len(records) - len(ok),
        "ttft_ms": describe([r.ttft for r in ok]), "e2el_ms": describe([r.e2el for r in ok]),
        "itl_ms": describe([x for r in ok for x in r.itls]),
        "ttft_ms_by_tag": {t: describe([r.ttft for r in rs]) for t, rs in by_tag.items()},
        "e2el_ms_by_tag": {t: describe([r.e2el for r in rs]) for t, rs in by_tag.items()},
        "throughput_tokens_per_s": (prompt_tokens + out_tokens) / makespan if makespan else 0,
        "throughput_requests_per_s": len(ok) / makespan if makespan else 0,
        # Per tag, over the span from the tag's first submission to its last token (e.g. the
        # steady state of repeated passes, without the first pass that fills the cache).
        "throughput_requests_per_s_by_tag": {
            t: len(rs) / span for t, rs in by_tag.items()
            if (span := sum(r.e2el for r in rs) if busy_spans else _span(rs)) > 0},
        "prompt_tokens": prompt_tokens, "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / max(prompt_tokens, 1),
        "replayed_anchors": sum(r.replayed_anchors for r in ok),
        "makespan_s": makespan,
    }
    if engine_stats is not None:
        cache, tiers = engine_stats.get("cache") or {}, engine_stats.get("tiers") or {}
        by_tier = cache.get("hit_tokens_by_tier", {})
        summary.update({
            "hit_rate_by_tier": {t: n / max(prompt_tokens, 1) for t, n in by_tier.items()},
            "recomputed_tokens": engine_stats.get("recomputed_tokens", 0),
            "live_state_hits": engine_stats.get("live_state_hits", 0),
            "prefetch": {k: tiers.get(k, 0) for k in ("prefetch_started", "prefetch_hits",
                                                      "prefetch_late")},
            "ssd_bytes_written": tiers.get("ssd_bytes_written", 0),
            # Steps a request stayed queued for its SSD reads while others ran.
            "deferred_admissions": tiers.get("deferred_admissions", 0),
            "cached_pages": engine_stats.get("cached_pages", 0),
            # Bytes in use when the workload ended, by pool (device KV / anchors / states,
            # DRAM tier, SSD tier files).
            "memory_bytes": engine_stats.get("memory_bytes", {}),
        })
        started = summary["prefetch"]["prefetch_started"]
        summary["prefetch_effectiveness"] = (summary["prefetch"]["prefetch_hits"] / started
                                             if started else None)
    return summary


def measure_in_process(model, config: EngineConfig, workload: Workload) -> tuple[dict, list]:
    engine = Engine(model, config)
    t0 = time.perf_counter()
    records = run_in_process(engine, workload)
    makespan = time.perf_counter() - t0
    stats = engine.stats()
    engine.store.assert_invariants()
    return summarize(records, stats, makespan), [asdict(r) | {"ttft": r.ttft, "e2el": r.e2el}
                                                 for r in records]
