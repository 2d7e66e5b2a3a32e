"""The burst benchmark, short, through two real servers: with share_running_prefills the
burst prefilled the shared prefix once; without it, at least as much."""

from __future__ import annotations

from client.bench import burst


def test_a_short_burst_shares_the_prefix_once(tmp_path):
    summary = burst.main(["--clients", "3", "--prefix-lens", "320", "--suffix", "32",
                          "--repeats", "1", "--max-tokens", "4",
                          "--out", str(tmp_path / "summary.json")])
    row = summary["by_prefix_tokens"]["320"]
    on, off = row["share"]["recomputed_tokens"], row["no_share"]["recomputed_tokens"]
    # The prompts share 5 whole 64-token pages: the first request prefills its 352 tokens,
    # each other one only its own 32, whether it waited for the first one's prefill or
    # arrived after it.
    assert on == 352 + 2 * 32, row
    # Without sharing, requests admitted beside the first one prefill everything (one that
    # arrives after the first one's prefill still hits).
    assert on <= off <= 3 * 352, row
    assert all(row[s]["all_done_ms"] > 0 and row[s]["mean_first_token_ms"] > 0
               for s in burst.SETTINGS)
    assert (tmp_path / "summary.json").exists()
