"""client/bench/bls.py, short, through a real server: both models stream every requested
token, the summary holds each one's times and the throughput ratio, the plot is written."""

from __future__ import annotations

from client.bench import bls


def test_both_models_are_timed(tmp_path):
    summary = bls.main(["--concurrency", "2", "--rounds", "2", "--max-tokens", "4",
                        "--prompt-tokens", "32", "--out", str(tmp_path / "summary.json")])
    row = summary["results"]["2"]
    for model in bls.PATHS:
        assert row[model]["ttft_ms"] > 0 and row[model]["itl_ms"] > 0
        assert row[model]["tokens_per_s"] > 0
    assert summary["bls_throughput_vs_ensemble"]["2"] == round(
        row["hybrid_llm_bls"]["tokens_per_s"] / row["ensemble"]["tokens_per_s"], 3)
    assert (tmp_path / "bls.png").stat().st_size > 0
