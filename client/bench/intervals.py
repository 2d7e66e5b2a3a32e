"""Bootstrap intervals for the suite's goal keys, from one run's per-request records.

Each key of issue 8 is a ratio measured once; on a 2-core host whose own speed varies by
about a fifth from second to second, a reader needs to know whether a miss (or a hit) is
within the run's noise. `key_intervals` resamples the requests behind each key (with
replacement, `n` times, a fixed seed) and recomputes the key as `run_suite.ratios` does,
giving the 5th and 95th percentiles: a 90% percentile-bootstrap interval.

Only the keys that are ratios of means get one. The distance key (the max over the min of
the cuts' medians) and the RAG P99 key (a P99 of 12-48 requests: their largest or next to
it) are extreme statistics that the bootstrap gets wrong: resampled repeats make the
largest of the noisy medians larger still (in each of the 57 stored runs most resampled
keys sat above the measured one), and a resample's P99 can only be one of the few largest
values measured. A percentile interval would not bracket these keys; their spread from run
to run is in docs/benchmark_history.md.

What is resampled, per key:
  - branching (ShareGPT, agentic trees): the branch requests, paired across the two
    systems (the workloads run interleaved, request by request, so a request's host noise
    lands on both of its measurements; pairing keeps it);
  - capacity: each system's repeat requests, one system independently of another (they run
    one after another); the key is a throughput ratio over spans that also hold the client's
    gaps between requests, so the interval is that of the service-time ratio scaled to the
    key (`_scaled`);
  - RAG (the TTFT speedups): the moderate rate's queries, paired by request id across the
    systems (the same queries, the same arrival times).
Requests are treated as independent: the systems that run one after another (capacity,
RAG) share none of each other's slow seconds, and open-loop requests queue behind each
other, so for those keys the interval is a lower bound on the run-to-run spread
(docs/benchmark_history.md has the spread of the stored runs).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from client.bench.suite import reduction

# The capacity key: ours against the checkpoint systems at working sets of at least this
# many times the device pool (issue 8; `run_suite.ratios` takes the smallest ratio of them).
CAPACITY_KEY_FACTOR = 4
BRANCHING_WORKLOADS = ("agentic16k", "agentic5k", "sharegpt")
LEVELS = (5.0, 95.0)


def _ok(rows: list[dict], tag: str | None = None) -> list[dict]:
    return [r for r in rows if not r.get("error") and (tag is None or r["tag"] == tag)]


def _paired(records: dict, workload: str, systems: tuple[str, ...], field: str,
            tag: str | None = None) -> np.ndarray | None:
    """[system, request] values of the requests every system answered (by request id)."""
    by_system = []
    for system in systems:
        rows = records.get(f"{workload}/{system}")
        if not rows:
            return None
        by_system.append({r["rid"]: r[field] for r in _ok(rows, tag)})
    common = sorted(set.intersection(*(set(d) for d in by_system)))
    if len(common) < 2:
        return None
    return np.array([[d[rid] for rid in common] for d in by_system])


def _interval(draws: list[float]) -> list[float] | None:
    finite = [d for d in draws if np.isfinite(d)]
    if not finite:
        return None
    lo, hi = np.percentile(finite, LEVELS)
    return [float(lo), float(hi)]


def _paired_interval(values: np.ndarray, stat: Callable[[np.ndarray], float],
                     rng: np.random.Generator, n: int) -> list[float] | None:
    m = values.shape[1]
    return _interval([stat(values[:, rng.integers(0, m, m)]) for _ in range(n)])


def _branching(records: dict, workload: str, rng, n: int) -> list[float] | None:
    values = _paired(records, workload, ("suffixreplay", "checkpoint"), "ttft", tag="branch")
    if values is None:
        return None
    return _paired_interval(values, lambda v: reduction(v[0].mean(), v[1].mean()), rng, n)


def _throughput(e2el: np.ndarray) -> float:
    return len(e2el) / e2el.sum()


def _scaled(draws: list[float], point: float, key: float) -> list[float] | None:
    """`draws` of an estimate whose value on the data is `point`, as an interval around
    `key` (the same ratio measured over a slightly different span)."""
    iv = _interval([d / point for d in draws])
    return None if iv is None else [key * iv[0], key * iv[1]]


def _capacity(records: dict, factors: list[int], key: float, rng, n: int) -> list[float] | None:
    """Ours over the better checkpoint system at each factor from CAPACITY_KEY_FACTOR on,
    the smallest of them."""
    per_factor = []
    for f in factors:
        if f < CAPACITY_KEY_FACTOR:
            continue
        e2el = {}
        for system in ("ours", "checkpoint", "pcr_dram"):
            rows = _ok(records.get(f"capacity_{f}x/{system}", []), tag="repeat")
            if len(rows) < 2:
                return None
            e2el[system] = np.array([r["e2el"] for r in rows])
        per_factor.append(e2el)
    if not per_factor:
        return None

    def ratio(sample: Callable[[np.ndarray], np.ndarray]) -> float:
        return min(_throughput(sample(e["ours"])) / max(_throughput(sample(e["checkpoint"])),
                                                         _throughput(sample(e["pcr_dram"])))
                   for e in per_factor)

    point = ratio(lambda a: a)
    draws = [ratio(lambda a: a[rng.integers(0, len(a), len(a))]) for _ in range(n)]
    return _scaled(draws, point, key)


def _rag(records: dict, moderate: str, rng, n: int) -> dict[str, list[float] | None]:
    out: dict[str, list[float] | None] = {}
    ttft = _paired(records, moderate, ("pcr_full", "lmcache_like", "nocache"), "ttft")
    if ttft is not None:
        out["pcr_ttft_speedup_vs_sccache"] = _paired_interval(
            ttft, lambda v: v[1].mean() / v[0].mean(), rng, n)
        out["pcr_ttft_speedup_vs_nocache"] = _paired_interval(
            ttft, lambda v: v[2].mean() / v[0].mean(), rng, n)
    return out


def key_intervals(records: dict[str, list[dict]], summary: dict, n: int = 2000,
                  seed: int = 0) -> dict[str, list[float] | None]:
    """{goal key: [5th, 95th percentile]} for the keys `summary` (`run_suite.ratios`) holds
    (None where the run has too few requests behind a key). records: `Runner.records`
    ({"workload/system": per-request rows})."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[float] | None] = {}
    for workload in BRANCHING_WORKLOADS:
        key = f"branching_ttft_reduction_vs_checkpoint_{workload}"
        if key in summary:
            out[key] = _branching(records, workload, rng, n)
    key = summary.get("capacity_throughput_ratio_vs_checkpoint")
    if key is not None and np.isfinite(key):
        factors = [int(f) for f in summary.get("capacity_throughput_ratio_by_factor", {})]
        out["capacity_throughput_ratio_vs_checkpoint"] = _capacity(records, factors, key,
                                                                   rng, n)
    rate = summary.get("rag_moderate_rate")  # the RAG keys' rate
    if rate is not None:
        out.update(_rag(records, f"rag_rate{rate:g}", rng, n))
    return out
