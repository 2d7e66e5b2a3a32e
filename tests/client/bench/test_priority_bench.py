"""The priority benchmark, short, through a real tritonserver: with the batch job at a lower
priority, the interactive requests no longer wait for a batch request to end."""

from __future__ import annotations

from client.bench import priority


def test_prioritized_chats_start_sooner_than_equal_ones(tmp_path):
    summary = priority.main(["--rounds", "2", "--chats-per-phase", "2", "--batch-tokens", "48",
                             "--batch-clients", "2", "--slots", "2",
                             "--out", str(tmp_path / "summary.json")])
    results = summary["results"]
    assert results["equal"]["chat"]["requests"] == results["prioritized"]["chat"]["requests"] \
        == 4
    assert summary["chat_ttft_speedup_prioritized_vs_equal"] > 1, results
    assert all(results[m]["batch_tokens_per_s"] > 0 for m in priority.MODES), results
    assert (tmp_path / "priority.png").stat().st_size > 0
