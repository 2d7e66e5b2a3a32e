"""The suite's report.md tables from a summary (no run)."""

from __future__ import annotations

from client.bench.report import cache_table

MIB = 1 << 20


def _system(**extra) -> dict:
    return {"replayed_anchors": 7, "recomputed_tokens": 300.0, "live_state_hits": 2.0,
            "hit_rate_by_tier": {"device": 0.25, "host": 0.5, "ssd": 0.125},
            "prefetch": {"prefetch_started": 4.0, "prefetch_hits": 3.0},
            "ssd_bytes_written": 3 * MIB, **extra}


def test_cache_table_shows_tiers_prefetches_and_bytes_in_use():
    results = {"rag": {
        "tiered": _system(memory_bytes={"device_kv": 2 * MIB, "device_anchors": MIB,
                                        "device_states": MIB, "host": 8 * MIB,
                                        "ssd": 16 * MIB}),
        "device_only": _system(memory_bytes={"device_kv": MIB, "device_anchors": 0,
                                             "device_states": 0}),
        "old": _system(),  # a summary from before the memory gauges
        "no_counters": {"replayed_anchors": 0},
    }}
    rows = cache_table(results, "rag").splitlines()
    assert len(rows) == 2 + 3  # header, rule, one row per system with engine counters
    assert rows[2] == ("| tiered | 0.25 | 0.50 | 0.12 | 300 | 7 | 2 | 4 / 3 | 3.0 "
                       "| 4.0 / 8.0 / 16.0 |")
    assert rows[3].endswith("| 1.0 / - / - |")
    assert rows[4].endswith("| n/a |")
