"""The OpenAI frontend benchmark, short, through a real server and a real frontend process:
both paths stream the requested tokens, and the summary reports the frontend's extra time."""

from __future__ import annotations

from client.bench import openai_frontend


def test_both_paths_are_timed(tmp_path):
    summary = openai_frontend.main(["--prompt-tokens", "64", "--rounds", "2", "--max-tokens",
                                    "4", "--out", str(tmp_path / "summary.json")])
    results = summary["results"]["64"]
    for path in openai_frontend.PATHS:
        assert results[path]["ttft_mean_ms"] > 0 and results[path]["itl_mean_ms"] > 0, results
    extra = summary["frontend_extra"]["64"]
    assert extra["ttft_ms"] == round(results["openai_frontend"]["ttft_mean_ms"]
                                     - results["triton_grpc"]["ttft_mean_ms"], 1)
    assert summary["logprobs_extra"]["64"]["itl_ms"] == round(
        results["openai_logprobs"]["itl_mean_ms"] - results["openai_frontend"]["itl_mean_ms"], 2)
    assert (tmp_path / "openai_frontend.png").stat().st_size > 0
