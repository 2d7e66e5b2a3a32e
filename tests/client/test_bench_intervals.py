"""The goal keys' bootstrap intervals (`client/bench/intervals.py`) from per-request records."""

from __future__ import annotations

import numpy as np
import pytest

from client.bench.intervals import key_intervals
from client.bench.report import ratio_table

BRANCH = "branching_ttft_reduction_vs_checkpoint_sharegpt"
CAPACITY = "capacity_throughput_ratio_vs_checkpoint"
SCCACHE = "pcr_ttft_speedup_vs_sccache"
NOCACHE = "pcr_ttft_speedup_vs_nocache"


def _rows(values, tag: str = "branch", field: str = "ttft", start: int = 0) -> list[dict]:
    return [{"rid": f"r{start + i}", "tag": tag, field: float(v), "error": None}
            for i, v in enumerate(values)]


def _rag(pcr, lmcache, nocache) -> dict:
    return {f"rag_rate3/{system}": _rows(values, "rag") for system, values in
            (("pcr_full", pcr), ("lmcache_like", lmcache), ("nocache", nocache))}


def test_paired_branch_requests_keep_their_shared_noise_out_of_the_interval():
    """Each branch request costs both systems alike up to a constant factor (the host noise a
    request meets lands on both: the workload is interleaved): resampled in pairs, the
    reduction is that factor in every resample, however much the requests differ."""
    base = np.random.default_rng(1).lognormal(-2.5, 0.8, 40)
    records = {"sharegpt/checkpoint": _rows(base), "sharegpt/suffixreplay": _rows(0.7 * base)}
    out = key_intervals(records, {BRANCH: 0.3})
    assert out[BRANCH] == pytest.approx([0.3, 0.3])


def test_branch_interval_brackets_the_key_and_narrows_with_more_requests():
    rng = np.random.default_rng(2)

    def interval(n: int) -> list[float]:
        base = rng.lognormal(-2.5, 0.5, n)
        ours = base * rng.lognormal(np.log(0.8), 0.3, n)
        records = {"sharegpt/checkpoint": _rows(base), "sharegpt/suffixreplay": _rows(ours)}
        key = 1 - ours.mean() / base.mean()
        lo, hi = key_intervals(records, {BRANCH: key})[BRANCH]
        assert lo < key < hi
        return [lo, hi]

    small, large = interval(12), interval(400)
    assert large[1] - large[0] < (small[1] - small[0]) / 2


def test_only_requests_every_system_answered_and_only_branches_count():
    """A request that failed on one system, a request only one system has, and the warm-up
    turns (another tag) stay out of the pairs."""
    ck = _rows([0.1, 5.0, 0.3, 0.4]) + _rows([9.0], tag="turn", start=10)
    ours = _rows([0.09, 2.5, 0.15, 0.2, 7.0]) + _rows([1.0], tag="turn", start=10)  # r4: alone
    ours[0]["error"] = "timed out"  # (0.09: not half of its pair's)
    records = {"sharegpt/checkpoint": ck, "sharegpt/suffixreplay": ours}
    assert key_intervals(records, {BRANCH: 0.5})[BRANCH] == pytest.approx([0.5, 0.5])


def test_too_few_requests_give_no_interval_and_missing_keys_none_at_all():
    records = {"sharegpt/checkpoint": _rows([0.1]), "sharegpt/suffixreplay": _rows([0.05])}
    assert key_intervals(records, {BRANCH: 0.5}) == {BRANCH: None}
    assert key_intervals(records, {}) == {}


def test_capacity_interval_is_the_service_time_ratio_scaled_to_the_key():
    """Ours against the faster of the two checkpoint systems; the key's spans hold the
    client's gaps as well, so the interval is placed around the key."""
    rows = {"ours": [0.1] * 8, "checkpoint": [0.5] * 8, "pcr_dram": [0.4] * 8}
    records = {f"capacity_4x/{s}": _rows(v, "repeat", "e2el") for s, v in rows.items()}
    records["capacity_4x/ours"] += _rows([3.0] * 8, "first", "e2el", start=8)  # first pass
    summary = {CAPACITY: 3.8, "capacity_throughput_ratio_by_factor": {"4": 3.8}}
    assert key_intervals(records, summary)[CAPACITY] == pytest.approx([3.8, 3.8])

    rng = np.random.default_rng(3)
    noisy = {s: np.array(v) * rng.lognormal(0, 0.2, 8) for s, v in rows.items()}
    records.update({f"capacity_4x/{s}": _rows(v, "repeat", "e2el") for s, v in noisy.items()})
    lo, hi = key_intervals(records, summary)[CAPACITY]
    assert lo < 3.8 < hi and hi - lo > 0.2


def test_capacity_takes_the_smallest_ratio_over_the_factors_from_4x():
    records = {}
    for f, ours in ((2, 0.05), (4, 0.1), (8, 0.2)):
        for system, e2el in (("ours", ours), ("checkpoint", 0.4), ("pcr_dram", 0.4)):
            records[f"capacity_{f}x/{system}"] = _rows([e2el] * 4, "repeat", "e2el")
    summary = {CAPACITY: 2.0, "capacity_throughput_ratio_by_factor": {2: 8.0, 4: 4.0, 8: 2.0}}
    # 8x sets the key (2.0); the 2x ratio (8.0) is no part of it: the interval is the key's.
    assert key_intervals(records, summary)[CAPACITY] == pytest.approx([2.0, 2.0])
    del records["capacity_8x/pcr_dram"]
    assert key_intervals(records, summary)[CAPACITY] is None


def test_rag_speedups_pair_the_moderate_rates_queries():
    q = np.random.default_rng(4).lognormal(-2, 1.0, 12)
    records = _rag(q, 1.25 * q, 2.0 * q)
    records["rag_rate6/pcr_full"] = _rows(100 * q, "rag")  # another rate: not the key's
    summary = {SCCACHE: 1.25, NOCACHE: 2.0, "rag_p99_e2el_reduction_vs_lmcache_like": 0.1,
               "rag_moderate_rate": 3.0}
    out = key_intervals(records, summary)
    assert out[SCCACHE] == pytest.approx([1.25, 1.25])
    assert out[NOCACHE] == pytest.approx([2.0, 2.0])
    # No interval for the P99 key (an extreme statistic: module docstring).
    assert "rag_p99_e2el_reduction_vs_lmcache_like" not in out


def test_report_places_the_goal_against_the_interval():
    summary = {BRANCH: 0.25, SCCACHE: 1.1, NOCACHE: 2.5, CAPACITY: 3.2,
               "key_intervals": {BRANCH: [0.05, 0.35], SCCACHE: [1.0, 1.2],
                                 NOCACHE: [2.1, 2.9], CAPACITY: None}}
    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[2:-1]]
            for line in ratio_table(summary).splitlines()[2:]}
    assert rows[BRANCH][:5] == ["0.250", "0.050 to 0.350", ">= 0.2", "yes", "within noise"]
    assert rows[SCCACHE][1:5] == ["1.000 to 1.200", ">= 1.3", "no", "missed"]
    assert rows[NOCACHE][4] == "met"
    assert rows[CAPACITY][1] == "-" and rows[CAPACITY][4] == "-"
    distance = rows["checkpoint_distance_ttft_max_over_min_suffixreplay"]
    assert distance[0] == "n/a" and distance[4] == "-"
