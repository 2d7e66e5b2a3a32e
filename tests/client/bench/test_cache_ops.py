"""Smoke test of the cache-ops benchmark at a tiny size (the numbers are not checked)."""

from __future__ import annotations

import json

import pytest

from client.bench import cache_ops

TINY = [
    "--num-pages",
    "600",
    "--seq-pages",
    "40",
    "--num-trunks",
    "2",
    "--trunk-pages",
    "4",
    "--prompt-pages",
    "8",
    "--num-queries",
    "20",
]


def test_summary_is_written_with_the_cli_prefill_time(tmp_path):
    out = tmp_path / "summary.json"
    summary = cache_ops.main(
        [*TINY, "--model", str(tmp_path / "missing"), "--prefill-ms", "10", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == summary
    assert summary["prefill_source"].startswith("cli:--prefill-ms")
    assert "config.json not found" in summary["prefill_source"]
    assert summary["tree_overhead_fraction"] == summary["request_tree_cost"]["mean_ms"] / 10
    assert summary["num_cached_pages"] > 0 and summary["match_ops_per_s"] > 0


def test_without_a_model_or_a_prefill_time_it_exits():
    with pytest.raises(SystemExit, match="--prefill-ms"):
        cache_ops.main([*TINY])
