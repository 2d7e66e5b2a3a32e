"""engine_build/calibrate.py (k_max and anchor density from replay quality) and how the engine
reads its calibration.json (`k_max: auto`, `anchor_density: auto`)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from hf_oracle import make_hf_checkpoint

from backend.engine import EngineConfig
from backend.engine.engine import apply_calibration
from backend.triton.errors import ConfigError
from backend.triton.llm_config import engine_params, serving_settings
from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO, read_parameters
from engine_build import build, calibrate


def _sweep(top1: dict[int, float]) -> dict[int, dict]:
    return {k: {"top1_agreement": v, "kl": 0.0, "state_error_by_group": [0.0], "num_cuts": 1}
            for k, v in top1.items()}


def test_choose_prefers_the_cheapest_density_that_meets_the_target():
    four = _sweep({4: 0.90, 8: 0.95, 16: 0.991, 32: 0.995})
    sixteen = _sweep({4: 0.96, 8: 0.992, 16: 0.999})
    assert calibrate.choose({4: four, 16: sixteen}, 0.99) == (4, 16, True)
    assert calibrate.choose({4: four, 16: sixteen}, 0.996) == (16, 16, True)
    # nothing meets it: the best agreement anywhere, the smallest k of equals
    weak = _sweep({4: 0.87, 8: 0.90, 16: 0.93, 32: 0.93})
    denser = _sweep({4: 0.88, 8: 0.95, 16: 0.969, 32: 0.969})
    assert calibrate.choose({4: weak, 16: denser}, 0.99) == (16, 16, False)
    assert calibrate.choose({4: weak}, 0.99) == (4, 16, False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "ckpt"
    make_hf_checkpoint(path, seed=3, vocab_size=260)  # the corpus is bytes
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the repository's need
        shutil.copy2(MODEL_REPO / DEFAULT_MODEL / name, path / name)
    return path


def test_calibrate_writes_what_the_engine_reads(checkpoint, capsys):
    out = calibrate.main(["--model", str(checkpoint), "--quick", "--target", "0.5",
                          "--anchors-per-page", "16", "4"])
    saved = json.loads((checkpoint / "calibration.json").read_text())
    assert saved["k_max"] == out["k_max"] and saved["target_met"] is True
    # 4 a page met the target: the denser density was not tried
    assert saved["anchors_per_page"] == 4 and list(saved["sweeps_by_anchors_per_page"]) == ["4"]
    assert (checkpoint / "calibration.png").stat().st_size > 0
    config = apply_calibration(checkpoint, EngineConfig.from_params(
        {"k_max": "auto", "anchor_density": "auto"}))
    assert config.replay.k_max == saved["k_max"]
    assert config.replay.anchor_density == config.cache.anchor_density == 4 / 64
    # an unreachable target: both densities tried, the best chosen, and said so
    out = calibrate.main(["--model", str(checkpoint), "--quick", "--target", "1.01",
                          "--anchors-per-page", "4", "16"])
    assert out["target_met"] is False and set(out["sweeps_by_anchors_per_page"]) == {"4", "16"}
    assert "warning: no k" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        calibrate.main(["--model", str(checkpoint), "--anchors-per-page", "0"])


def test_engine_applies_and_checks_the_calibration(tmp_path, caplog):
    calib = {"k_max": 256, "anchors_per_page": 16, "page_size": 64, "target_met": False,
             "target_top1_agreement": 0.99, "top1_agreement": 0.969}
    (tmp_path / "calibration.json").write_text(json.dumps(calib))
    auto = EngineConfig.from_params({"k_max": "auto", "anchor_density": "auto"})
    with caplog.at_level(logging.WARNING, logger="backend.engine.engine"):
        config = apply_calibration(tmp_path, auto)
    assert (config.replay.k_max, config.replay.anchor_density) == (256, 0.25)
    assert config.cache.anchor_density == 0.25 and config.cache.anchors_per_page == 16
    assert "did not reach its target" in caplog.text
    # k_max from a calibration at another density than the one served: a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="backend.engine.engine"):
        config = apply_calibration(tmp_path, EngineConfig.from_params({"k_max": "auto"}))
    assert config.replay.k_max == 256 and config.replay.anchor_density == 1 / 16
    assert "may not hold" in caplog.text
    # nothing asked: nothing read
    plain = EngineConfig.from_params({"k_max": "64"})
    assert apply_calibration(tmp_path, plain) is plain
    # no calibration: the configured values, with a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="backend.engine.engine"):
        config = apply_calibration(tmp_path / "missing", auto)
    assert config.replay.k_max == auto.replay.k_max and "missing" in caplog.text
    (tmp_path / "calibration.json").write_text("{broken")
    with pytest.raises(ValueError, match="unreadable calibration"):
        apply_calibration(tmp_path, auto)


def test_build_with_calibrate_serves_both_values_auto(checkpoint, tmp_path):
    """The calibration goes into the repository it builds (the served model reads it from
    there); the checkpoint's own calibration, if any, is left as it was."""
    (checkpoint / "calibration.json").write_text(json.dumps({"k_max": 2, "anchors_per_page": 8,
                                                             "page_size": 64}))
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    assert build.main(["--model", str(checkpoint), "--repo", str(tmp_path / "repo"),
                       "--calibrate"]) == 0
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
    model = tmp_path / "repo" / "hybrid_llm"
    params = read_parameters(model / "config.pbtxt")
    assert params["k_max"] == "auto" and params["anchor_density"] == "auto"
    assert params["calibration_path"] == "1/calibration.json"
    assert (model / "1" / "calibration.png").stat().st_size > 0
    calib = json.loads((model / "1" / "calibration.json").read_text())
    assert calib["anchors_per_page"] in (4, 16)
    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    settings = serving_settings(config, model)
    assert settings.calibration_path == model / "1" / "calibration.json"
    served = apply_calibration(settings.model_path, EngineConfig.from_params(
        engine_params(config)), settings.calibration_path)
    assert served.replay.k_max == calib["k_max"]
    assert served.replay.anchor_density == calib["anchors_per_page"] / 64
    # a calibration_path naming no file is a configuration error
    config["parameters"]["calibration_path"] = {"string_value": "1/missing.json"}
    with pytest.raises(ConfigError, match="calibration_path"):
        serving_settings(config, model)
