"""The K-sequences benchmark, short, through a real server: every way ran, and
num_return_sequences prefilled the shared prompt about once while K separate requests in
their own namespaces prefilled it K times."""

from __future__ import annotations

from client.bench import sequences


def test_a_short_run_measures_every_way(tmp_path):
    summary = sequences.main(["--k", "3", "--prompt-lens", "320", "--repeats", "1",
                              "--max-tokens", "4", "--out", str(tmp_path / "summary.json")])
    row = summary["by_prompt_tokens"]["320"]
    assert set(sequences.WAYS) <= set(row)
    own = row["k_requests_own_salts"]["recomputed_tokens"]
    ours = row["num_return_sequences"]["recomputed_tokens"]
    assert own == 3 * 320  # each request prefills the whole prompt
    # The first sequence prefills 320 tokens; each sibling only what follows the last whole
    # 64-token page of the prompt (at most a page).
    assert 320 <= ours <= 320 + 2 * 64, row
    assert row["prefilled_ratio_vs_own_salts"] < 0.6
    assert all(row[w]["all_done_ms"] > 0 for w in sequences.WAYS)
    assert (tmp_path / "summary.json").exists()
