"""client/bench/lora.py on a small run: every case measured, ratios against the base model,
the plot written."""

from __future__ import annotations

from client.bench import lora


def test_a_small_run_measures_every_case(tmp_path):
    out = tmp_path / "summary.json"
    summary = lora.main(["--requests", "4", "--prompt-len", "64", "--max-tokens", "4",
                         "--repeats", "1", "--rank", "4", "--out", str(out)])
    assert set(summary["cases"]) == set(lora.CASES)
    for row in summary["cases"].values():
        assert row["round_ms"] >= row["last_first_token_ms"] >= row["ttft_mean_ms"] > 0
        assert row["decode_tokens_per_second"] > 0
    assert summary["decode_throughput_vs_base"]["base"] == 1.0
    assert summary["adapter_layers"] > 0
    assert out.is_file() and (tmp_path / "lora.png").stat().st_size > 0
