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


def test_engine_parameters_that_cannot_work_fail_the_load_naming_them(tmp_path):
    """Each was accepted: a tier key alone turned on 1024 DRAM pages; a checkpoint cache
    without slots never hit; a whitespace count past XGrammar's C int failed every guided
    request; a million I/O threads or pools past memory failed with torch's or the thread
    module's words; a port past 65535 bound another port; an engine-stage error (an SSD path
    that is a file) blamed model_path."""
    from backend.engine.config import EngineConfig
    from backend.triton.hybrid_llm import build_engine
    from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO

    for params, message in (
            ({"host_checkpoint_slots": "4"}, "host_checkpoint_slots configure the tiers below "
                                             "the device, which are off: set host_pages"),
            ({"prefetch_window": "2", "io_threads": "4"}, "io_threads, prefetch_window"),
            ({"cache_policy": "checkpoint", "num_checkpoint_slots": "0"},
             "num_checkpoint_slots: it must be >= 1"),
            ({"guided_json_whitespace": str(2**31)}, r"number in 1..2147483647, got '2147483648'"),
            ({"guided_json_whitespace": "²"}, "guided_json_whitespace must be"),
            ({"host_pages": "8", "io_threads": "1000000"}, r"io_threads must be in 1..256")):
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_params(params)
    # left at their defaults (host_checkpoint_slots=0: "empty = 0"), they change nothing
    assert EngineConfig.from_params({"host_checkpoint_slots": "0", "ssd_bytes": ""}).tiers is None
    assert EngineConfig.from_params({"host_pages": "8"}).tiers.host_pages == 8
    settings = serving_settings(config(model_path=str(MODEL_REPO / DEFAULT_MODEL)), tmp_path)
    for params, message in (
            ({"num_kv_pages": str(10**12)}, r"pools do not fit in memory .*num_kv_pages"),
            ({"kv_events_endpoint": "tcp://127.0.0.1:99999"},
             r"kv_events_endpoint 'tcp://127.0.0.1:99999': the port must be \* or 0..65535")):
        with pytest.raises(ConfigError, match=message):
            build_engine(settings, params)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="cannot start the engine on model_path=.*afile") as e:
        build_engine(settings, {"ssd_path": str(tmp_path / "afile")})
    assert "parameter model_path" not in str(e.value)
