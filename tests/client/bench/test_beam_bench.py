"""The beam-search benchmark, short: every width ran under both systems, sharing the store's
pages held fewer pages and copied fewer than copying them, and the plot was written."""

from __future__ import annotations

import json

from client.bench import beam


def test_a_short_run_measures_both_systems(tmp_path):
    out = tmp_path / "summary.json"
    summary = beam.main(["--widths", "1", "4", "--max-tokens", "24", "--repeats", "1",
                         "--prompt-tokens", "200", "--out", str(out)])
    results = summary["results"]
    assert set(results) == {"w1", "w4"}
    for row in results.values():
        assert set(row) == {"shared", "copied"}
        assert all(r["seconds"] > 0 and r["peak_pages"] > 0 for r in row.values())
    assert results["w1"]["shared"]["forks"] == 0
    wide = results["w4"]
    assert wide["shared"]["forks"] > 0 and wide["shared"]["forks"] == wide["copied"]["forks"]
    assert wide["shared"]["pages_copied"] < wide["copied"]["pages_copied"]
    assert wide["shared"]["peak_pages"] < wide["copied"]["peak_pages"]
    assert summary["peak_pages_copied_over_shared"]["w4"] > 1
    assert (tmp_path / "beam.png").stat().st_size > 0
    assert json.loads(out.read_text())["config"]["widths"] == [1, 4]
