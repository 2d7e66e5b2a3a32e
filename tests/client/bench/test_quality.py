"""client/bench/quality.py on a small checkpoint: every variant scored, the calibrated one at
its calibration's anchor density."""

from __future__ import annotations

import json

from hf_oracle import make_hf_checkpoint

from backend.model import load_model
from client.bench import quality


def test_quality_replays_the_calibrated_variant_at_its_density(tmp_path):
    ckpt = tmp_path / "ckpt"
    make_hf_checkpoint(ckpt, seed=5, vocab_size=260)
    (ckpt / "calibration.json").write_text(json.dumps(
        {"k_max": 8, "anchors_per_page": 16, "page_size": 64}))
    summary = quality.main(["--model", str(ckpt), "--quick", "--out", str(tmp_path / "q")])
    assert summary["calibrated_k_max"] == 8 and summary["calibrated_anchors_per_page"] == 16
    assert (tmp_path / "q" / "summary.json").exists()
    assert (tmp_path / "q" / "quality_vs_k.png").stat().st_size > 0
    for part in ("retrieval", "heldout"):
        assert set(summary[part]) == {"full", *quality.variants(8, 16)}
    # anchors at 16 a page cost four times those at 4 a page
    storage = summary["storage"]
    assert abs(storage["ratio_vs_checkpoint_calibrated_density"]
               - 4 * storage["ratio_vs_checkpoint"]) < 1e-9
    # a case captures the anchors of both densities
    case = quality.Case(load_model(ckpt), list(range(40, 240)) * 3, [65, 66], densities=(4, 16))
    assert case.hidden["dense_tail", 16].shape[1] == 4 * case.hidden["dense_tail", 4].shape[1]
