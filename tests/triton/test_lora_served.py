"""LoRA adapters on the served model: hybrid_llm's `lora_adapters` parameter loads a PEFT
adapter, the ensemble's `lora_name` input runs a request on it (the text the in-process engine
gives on that adapter, not the base model's), its prefixes are cached apart, an unknown name
is INVALID_ARG; the OpenAI frontend lists the adapter as a model (with its parent) and runs a
request whose `model` names it on the adapter; the CLI's --lora."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from hf_oracle import make_lora_adapter

from backend.engine import Engine, EngineConfig, SamplingParams
from client.generate import GenerateError, GenerateParams, generate_http, update_lora
from tests.triton.conftest import DEFAULT_MODEL, LLM_MODELS, LLM_PARAMS, MODEL_REPO
from tests.triton.llm_helpers import long_prompt, post_json, running_frontend

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
TARGETS = ("q_proj", "v_proj", "in_proj_qkv", "out_proj", "gate_proj", "down_proj")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(MODEL_REPO / DEFAULT_MODEL, dtype=torch.float32)
    return make_lora_adapter(tmp_path_factory.mktemp("served-lora"), hf, TARGETS, seed=5,
                             std=0.08)


@pytest.fixture(scope="module")
def server(triton_server, adapter):
    params = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "lora_adapters": f"tutor={adapter}",
                             "allow_runtime_lora": "true"}}
    return triton_server(LLM_MODELS, params)


@pytest.fixture(scope="module")
def local(server, adapter) -> Engine:
    """The in-process engine on the served model with the same adapter."""
    model_dir = Path(server.model_repository) / DEFAULT_MODEL
    return Engine.from_model_dir(model_dir, EngineConfig(lora_adapters=f"tutor={adapter}"))


def _params(prompt: str, **options) -> GenerateParams:
    options.setdefault("cache_salt", uuid.uuid4().hex)
    return GenerateParams(prompt, max_tokens=MAX_TOKENS, top_k=1, **options)


def test_a_request_runs_on_the_adapter_it_names(server, local):
    prompt = long_prompt("Once upon a time", 150)
    salt = uuid.uuid4().hex
    base = generate_http(server.urls.http, _params(prompt, cache_salt=salt))
    tuned = generate_http(server.urls.http, _params(prompt, cache_salt=salt, lora_name="tutor"))
    ids = local.tokenizer.encode(prompt)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, top_k=1)
    want = local.generate(ids, sampling, lora_name="tutor").new_token_ids
    assert tuned.text == local.tokenizer.decode(want, skip_special_tokens=True)
    assert tuned.text != base.text  # the adapter changes what the model says
    assert tuned.counts["cached_tokens"] == 0  # the base model's pages are not the adapter's
    again = generate_http(server.urls.http, _params(prompt, cache_salt=salt, lora_name="tutor"))
    assert again.text == tuned.text and again.counts["cached_tokens"] > 0


def test_an_unknown_adapter_is_invalid_arg(server):
    with pytest.raises(GenerateError, match="unknown LoRA adapter 'nope' \\(loaded: tutor\\)"):
        generate_http(server.urls.http, _params("Hello", lora_name="nope"))


def test_the_cli_runs_on_an_adapter(server):
    prompt = long_prompt("The sea", 80)
    want = generate_http(server.urls.http, _params(prompt, lora_name="tutor")).text
    result = subprocess.run(
        [sys.executable, "-m", "client", "generate", prompt, "--url", server.urls.grpc,
         "--max-tokens", str(MAX_TOKENS), "--top-k", "1", "--lora", "tutor",
         "--cache-salt", uuid.uuid4().hex],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"


def test_the_frontend_serves_the_adapter_as_a_model(server, tmp_path):
    prompt = long_prompt("A short story", 120)
    want = generate_http(server.urls.http, _params(prompt, lora_name="tutor")).text
    base = generate_http(server.urls.http, _params(prompt)).text
    with running_frontend(server, tmp_path / "frontend.log") as url:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
            models = {m["id"]: m for m in json.loads(resp.read())["data"]}
        assert set(models) == {"ensemble", "tutor"}
        assert models["tutor"]["parent"] == "ensemble" and "parent" not in models["ensemble"]
        texts = {}
        for model in ("tutor", "ensemble"):
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                               "temperature": 0, "cache_salt": uuid.uuid4().hex}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                answer = json.loads(resp.read())
            assert answer["model"] == model
            texts[model] = answer["choices"][0]["text"]
    assert texts == {"tutor": want, "ensemble": base}


@pytest.fixture(scope="module")
def second(tmp_path_factory) -> Path:
    """Another adapter, loaded at run time."""
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(MODEL_REPO / DEFAULT_MODEL, dtype=torch.float32)
    return make_lora_adapter(tmp_path_factory.mktemp("served-lora-2"), hf, TARGETS, seed=6,
                             std=0.08)


def test_adapters_load_and_unload_while_serving(server, local, second):
    prompt = long_prompt("Runtime adapters", 100)
    with pytest.raises(GenerateError, match="unknown LoRA adapter 'coach'"):
        generate_http(server.urls.http, _params(prompt, lora_name="coach"))
    assert update_lora(server.urls.grpc, "load", "coach", str(second)) == {}
    local.load_lora("coach", second)
    ids = local.tokenizer.encode(prompt)
    want = local.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, top_k=1),
                          lora_name="coach").new_token_ids
    salt = uuid.uuid4().hex
    got = generate_http(server.urls.http, _params(prompt, cache_salt=salt, lora_name="coach"))
    assert got.text == local.tokenizer.decode(want, skip_special_tokens=True)
    with pytest.raises(GenerateError, match="already loaded"):
        update_lora(server.urls.grpc, "load", "coach", str(second))
    assert update_lora(server.urls.grpc, "unload", "coach")["dropped_pages"] >= 100 // 64
    with pytest.raises(GenerateError, match="unknown LoRA adapter 'coach'"):
        generate_http(server.urls.http, _params(prompt, lora_name="coach"))
    with pytest.raises(GenerateError, match="lora_path"):
        update_lora(server.urls.grpc, "load", "coach")


def test_runtime_updates_are_off_unless_allowed(llm_server, second):
    with pytest.raises(GenerateError, match="allow_runtime_lora"):
        update_lora(llm_server.urls.grpc, "load", "coach", str(second))


def test_the_frontend_loads_and_unloads_adapters(server, second, tmp_path):
    load = {"lora_name": "mentor", "lora_path": str(second)}
    with running_frontend(server, tmp_path / "off.log") as url:
        assert post_json(f"{url}/v1/load_lora_adapter", load)[0] == 404
    with running_frontend(server, tmp_path / "on.log", "--enable-lora-updates") as url:
        status, body = post_json(f"{url}/v1/load_lora_adapter", load)
        assert status == 200, body
        assert body["replicas"] == [{"url": server.urls.grpc}]
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
            models = {m["id"]: m for m in json.loads(resp.read())["data"]}
        assert models["mentor"]["parent"] == "ensemble"
        prompt = long_prompt("Mentor says", 90)
        body = json.dumps({"model": "mentor", "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0, "cache_salt": uuid.uuid4().hex}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
        assert text == generate_http(server.urls.http,
                                     _params(prompt, lora_name="mentor")).text
        assert post_json(f"{url}/v1/load_lora_adapter", load)[0] == 400  # the name exists
        assert post_json(f"{url}/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400
        status, body = post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": "mentor"})
        assert status == 200 and body["replicas"][0]["dropped_pages"] >= 0
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
            assert "mentor" not in {m["id"] for m in json.loads(resp.read())["data"]}
        assert post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": "mentor"})[0] == 404
        bad = {"lora_name": "broken", "lora_path": str(tmp_path)}  # no adapter there
        status, body = post_json(f"{url}/v1/load_lora_adapter", bad)
        assert status == 400 and "adapter_config.json" in body["error"]["message"]
        # loaded on the server, not through this frontend (before it started): the unload
        # goes to the replicas (it was a 404 the adapter could not leave by)
        update_lora(server.urls.grpc, "load", "elder", str(second))
        status, body = post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": "elder"})
        assert status == 200 and body["replicas"][0]["dropped_pages"] >= 0, body
        assert post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": "elder"})[0] == 404


def test_a_load_that_fails_on_one_replica_is_undone_on_the_others(server, second, tmp_path):
    """The same server named twice (two replicas: the second load of a name fails as already
    loaded): the frontend unloads it again from the replica that loaded it, so the name is
    on none of them and a retry can succeed, where before it stayed loaded behind a name the
    frontend did not know (neither a retry nor an unload could reach it). An unload that
    finds it gone on some replicas finishes on the others."""
    twice = ["--enable-lora-updates", "--triton-url", server.urls.grpc]
    with running_frontend(server, tmp_path / "twice.log", *twice) as url:
        load = {"lora_name": "twin", "lora_path": str(second)}
        status, body = post_json(f"{url}/v1/load_lora_adapter", load)
        assert status == 400 and "already loaded" in body["error"]["message"], body
        assert "unloaded again from the 1 replica(s)" in body["error"]["message"]
        with pytest.raises(GenerateError, match="unknown LoRA adapter 'twin'"):
            update_lora(server.urls.grpc, "unload", "twin")  # on none of them
        update_lora(server.urls.grpc, "load", "twin", str(second))
        status, body = post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": "twin"})
        assert status == 200, body
        assert sorted(r.get("held", True) for r in body["replicas"]) == [False, True]
