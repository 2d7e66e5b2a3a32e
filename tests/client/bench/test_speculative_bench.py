"""The speculative-decoding benchmark, short: every system ran every workload to its token
count, drafts were kept where the output quotes the prompt, suffix decoding drafted from
earlier outputs where the same code was asked again, and the plot was written."""

from __future__ import annotations

import json

from client.bench import speculative


def test_a_short_run_measures_every_system(tmp_path):
    out = tmp_path / "summary.json"
    summary = speculative.main(["--batches", "2", "--max-tokens", "24", "--repeats", "1",
                                "--prompt-tokens", "120", "--out", str(out)])
    results = summary["results"]
    assert set(results) == {"code_b2", "quote_b2", "sampled_b2", "repeat_b2"}
    for row in results.values():
        assert {r["output_tokens"] for r in row.values()} == {2 * 24}
        assert row["off"]["drafted"] == 0 and row["off"]["steps"] >= 24
        assert all(r["decode_tokens_per_s"] > 0 for r in row.values())
    quote = results["quote_b2"]["whole"]
    assert quote["kept"] > 0 and quote["steps"] < results["quote_b2"]["off"]["steps"]
    assert set(summary["speedup"]["code_b2"]) == {"adaptive", "whole", "suffix"}
    # asked again in one namespace: suffix decoding drafts from the earlier outputs
    repeat = results["repeat_b2"]
    # (proposals: the adaptive policy may still cut them; the engine tests count the steps)
    assert repeat["suffix"]["corpus_drafts"] > 0 and repeat["whole"]["corpus_drafts"] == 0
    assert (tmp_path / "speculative.png").stat().st_size > 0
    assert json.loads(out.read_text())["config"]["batches"] == [2]
