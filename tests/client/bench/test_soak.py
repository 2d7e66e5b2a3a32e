"""The soak against one of the suite's systems (`--system`): parameters, and a short run of a
tiered system through a real server with cancelling clients."""

from __future__ import annotations

import pytest

from client.bench import soak


def test_system_parameters_put_the_tiers_under_a_small_device_budget(tmp_path):
    assert soak.server_params(None, tmp_path) == {}
    params = soak.server_params("ours", tmp_path)
    assert params["cache_policy"] == "suffixreplay"
    assert params["enable_ssd"] == "true" and params["ssd_path"] == str(tmp_path)
    # A DRAM slot holds its page's anchor block too: fewer pages than the budget's count,
    # the same bytes (tests/client/test_bench_suite.py checks the bytes).
    assert 0.85 * soak.SOAK_BUDGET.host_pages <= int(params["host_pages"]) \
        < soak.SOAK_BUDGET.host_pages
    assert soak.server_params("checkpoint", tmp_path)["cache_policy"] == "checkpoint"
    assert soak.parse_args(["--system", "ours"]).out.name == "summary_ours.json"
    assert soak.parse_args([]).out.name == "summary.json"
    with pytest.raises(SystemExit):
        soak.parse_args(["--system", "vllm"])


def test_a_short_soak_of_suffix_replay_over_ssd_ends_clean(tmp_path):
    summary = soak.main(["--system", "ours", "--minutes", "0.25", "--clients", "8",
                         "--warmup-s", "3", "--sample-every", "5",
                         "--out", str(tmp_path / "summary.json")])
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["requests"] > 20 and summary["cancelled"] > 0
    assert summary["pages_held_at_end"] == 0
    assert summary["config"]["system"] == "ours"
    assert (tmp_path / "summary.json").exists()
