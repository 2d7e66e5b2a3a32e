"""The benchmarks' shared statistics (`client/bench/common.py`)."""

from __future__ import annotations

from client.bench.common import median_row, ttft_stats


def test_p95_is_the_nearest_rank_and_rates_stay_rates():
    """P95 of 20 values is the 19th (it was the 20th: the maximum), and a rate per second
    (`*_per_s`) is not a time in seconds to turn into milliseconds."""
    rows = [{"ttft_s": i / 1000, "cached": 0, "prompt": 1} for i in range(1, 21)]
    assert ttft_stats(rows)["ttft_p95_ms"] == 19.0
    assert ttft_stats(rows[:1])["ttft_p95_ms"] == 1.0
    assert median_row([{"decode_tokens_per_s": 10.0, "ttft_s": 0.5},
                       {"decode_tokens_per_s": 30.0, "ttft_s": 0.7}]) == {
        "decode_tokens_per_s": 20.0, "ttft_ms": 600.0}
