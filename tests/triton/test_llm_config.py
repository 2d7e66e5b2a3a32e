"""hybrid_llm's config.pbtxt parameters: our keys, the engine's keys, and a bad value that
stops the model from loading with a message naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.triton.errors import ConfigError
from backend.triton.llm_config import engine_params, serving_settings
from backend.triton.repo import read_parameters
from backend.triton.server import start_server
from tests.triton.conftest import copy_models, ensure_model, free_ports, set_parameters

ROOT = Path(__file__).resolve().parents[2]


def config(**params: str) -> dict:
    return {"parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_model_path_is_relative_to_the_model_folder(tmp_path):
    (tmp_path / "1" / "m").mkdir(parents=True)
    (tmp_path / "1" / "m" / "config.json").write_text(json.dumps({}))
    settings = serving_settings(config(model_path="1/m", stats_check_period_ms="50"), tmp_path)
    assert settings.model_path == tmp_path / "1" / "m"
    assert settings.stats_check_period_ms == 50 and settings.exclude_input_in_output


def test_missing_model_and_bad_values_name_the_parameter(tmp_path):
    with pytest.raises(ConfigError, match="model_path='nowhere'"):
        serving_settings(config(model_path="nowhere"), tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="stats_check_period_ms must be an integer, got 'x'"):
        serving_settings(config(model_path=str(tmp_path), stats_check_period_ms="x"), tmp_path)


def test_guided_decoding_backend(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    base = {"model_path": str(tmp_path)}
    assert serving_settings(config(**base), tmp_path).guided_decoding_backend == "xgrammar"
    off = config(**base, guided_decoding_backend="None")
    assert serving_settings(off, tmp_path).guided_decoding_backend == "none"
    with pytest.raises(ConfigError, match="guided_decoding_backend must be one of xgrammar, "
                                          "none, got 'outlines'"):
        serving_settings(config(**base, guided_decoding_backend="outlines"), tmp_path)
    assert "guided_decoding_backend" not in engine_params(off)


def test_engine_params_skip_ours_and_unset_values():
    got = engine_params(
        config(model_path="m", page_size="64", ssd_path="", k_max="${k_max}", cache_policy="none")
    )
    assert got == {"page_size": "64", "cache_policy": "none"}


def test_bad_parameter_fails_the_load_naming_it(tmp_path):
    repo = copy_models(["hybrid_llm"], tmp_path / "repo", [])
    ensure_model(repo)
    set_parameters(repo / "hybrid_llm" / "config.pbtxt", {"page_size": "sixty-four"})
    http, grpc, metrics = free_ports(3)
    server = start_server(
        repo,
        http,
        grpc,
        metrics,
        log_path=tmp_path / "log.txt",
        extra_args=["--model-control-mode=explicit", "--load-model=hybrid_llm"],
    )
    try:
        with pytest.raises(RuntimeError):  # the server exits: its only model failed to load
            server.wait_ready(120)
    finally:
        server.stop()
    log = (tmp_path / "log.txt").read_text()
    assert "page_size" in log and "sixty-four" in log


def test_set_and_read_parameters_round_trip(tmp_path):
    config = tmp_path / "config.pbtxt"
    config.write_text((ROOT / "model_repo" / "hybrid_llm" / "config.pbtxt").read_text())
    set_parameters(config, {"page_size": "32", "brand_new": "x"})
    params = read_parameters(config)
    assert params["page_size"] == "32" and params["brand_new"] == "x"
    assert params["cache_policy"] == "suffixreplay" and params["ssd_path"] == ""
