"""`hybrid_llm_bls` (`backend/triton/bls.py`): the ensemble's pipeline in one decoupled
model. Its inputs and outputs are the ensemble's; through the real tritonserver its responses
are the ensemble's, response by response (streamed, not streamed, several sequences, beam
search, log probabilities, stop words, guided decoding, errors); a client that cancels stops
the generation; and a stream running when tritonserver is told to stop runs to its end."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest

from backend.triton.bls import HybridLlmBls, ensemble_steps, read_config
from backend.triton.errors import ConfigError
from client.generate import (
    GenerateError,
    GenerateParams,
    stream_grpc,
    stream_grpc_batch,
    stream_http,
)
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS, MODEL_REPO, launch
from tests.triton.llm_helpers import (
    idle_pool,
    pool_state,
    running_frontend,
    scrape,
    value,
    wait_until,
)

BLS = "hybrid_llm_bls"
MODELS = (*LLM_MODELS, BLS)


def test_its_inputs_and_outputs_are_the_ensembles():
    ensemble = read_config(MODEL_REPO / "ensemble" / "config.pbtxt")
    bls = read_config(MODEL_REPO / BLS / "config.pbtxt")
    assert bls["input"] == ensemble["input"] and bls["output"] == ensemble["output"]
    assert bls["max_batch_size"] == ensemble["max_batch_size"]
    assert bls["model_transaction_policy"]["decoupled"] is True
    steps = ensemble_steps(ensemble)
    assert [s.model for s in steps] == ["preprocessing", "hybrid_llm", "postprocessing"]
    hybrid = read_config(MODEL_REPO / "hybrid_llm" / "config.pbtxt")
    assert "response_final" in {o["name"] for o in hybrid["output"]}


def test_an_ensemble_it_cannot_follow_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_config(tmp_path / "missing" / "config.pbtxt")
    (tmp_path / "config.pbtxt").write_text("name: 'x' input [ { name: ")
    with pytest.raises(ConfigError, match="cannot read"):
        read_config(tmp_path / "config.pbtxt")
    steps = read_config(MODEL_REPO / "ensemble" / "config.pbtxt")
    steps["ensemble_scheduling"]["step"].reverse()
    with pytest.raises(ConfigError, match="preprocessing -> the LLM -> postprocessing"):
        ensemble_steps(steps)


@pytest.mark.parametrize("period", ["0", "-5", "1.5"])
def test_a_cancellation_period_that_is_no_positive_integer_is_a_config_error(period):
    config = read_config(MODEL_REPO / BLS / "config.pbtxt")
    config["parameters"]["cancellation_check_period_ms"] = {"string_value": period}
    args = {"model_config": json.dumps(config), "model_repository": str(MODEL_REPO / BLS)}
    with pytest.raises(ConfigError, match=f"must be an integer > 0, got '{period}'"):
        HybridLlmBls(None, args)  # (0 had the cancel watcher spin: wait(0) in a loop)


@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server(MODELS, LLM_PARAMS)


def _chunks(url: str, params: GenerateParams, model: str, stream: bool = True) -> list[dict]:
    """What a client sees of each response (timings left out)."""
    out = []
    for c in stream_grpc(url, params, stream=stream, model=model):
        out.append({
            "texts": c.texts, "final": c.final, "sequence_index": c.sequence_index,
            "finish_reasons": c.finish_reasons, "counts": c.counts,
            "log_probs": np.round(np.asarray(c.log_probs_by_sequence, dtype=float), 5).tolist(),
            "top_ids": None if c.top_log_prob_ids is None else c.top_log_prob_ids.tolist()})
    return out


CASES = {
    "greedy": dict(max_tokens=24, top_k=1),
    "sampled": dict(max_tokens=16, temperature=0.8, seed=7),
    "sequences": dict(max_tokens=10, top_k=1, num_return_sequences=3),
    "beams": dict(max_tokens=8, beam_width=3),
    "log_probs": dict(max_tokens=8, top_k=1, return_log_probs=True, num_top_log_probs=3),
    "stop_word": dict(max_tokens=40, top_k=1, stop_words=(" ",)),
    "guided": dict(max_tokens=40, top_k=1, guide_type="json_schema", guide=json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})),
}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("case", list(CASES))
def test_its_responses_are_the_ensembles(server, case, stream):
    url = server.urls.grpc
    seen = {}
    for model in ("ensemble", BLS):  # each from a cold cache: the same counts too
        params = GenerateParams("The capital of France is", cache_salt=uuid.uuid4().hex,
                                **CASES[case])
        seen[model] = _chunks(url, params, model, stream)
    assert seen[BLS] == seen["ensemble"]
    assert seen[BLS][-1]["final"] and sum(c["final"] for c in seen[BLS]) == 1
    assert "".join("".join(c["texts"]) for c in seen[BLS])


def _http(server, model: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.urls.http}/v2/models/{model}/generate",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_generate_and_errors_are_the_ensembles(server):
    body = {"text_input": "Hello", "max_tokens": 8, "top_k": 1}
    replies = {}
    for model in ("ensemble", BLS):
        status, reply = _http(server, model, {**body, "cache_salt": uuid.uuid4().hex})
        assert status == 200, reply
        # outputs only: not the model's name, nor the sequence parameters Triton echoes for
        # ensembles (sequence_id / _start / _end)
        replies[model] = {k: v for k, v in reply.items()
                          if k not in ("model_name", "sequence_id", "sequence_start",
                                       "sequence_end")}
    assert replies[BLS] == replies["ensemble"]
    for bad in ({"text_input": "Hello", "max_tokens": 0},  # preprocessing refuses it
                {"text_input": "Hello", "max_tokens": 4, "guided_decoding_guide_type": "regex",
                 "guided_decoding_guide": "(("}):  # hybrid_llm refuses it
        errors = {model: _http(server, model, bad) for model in ("ensemble", BLS)}
        assert errors[BLS][0] == errors["ensemble"][0] == 400
        message = errors[BLS][1]["error"]
        assert message and errors["ensemble"][1]["error"].endswith(message)
    # Streamed, the model's error comes as a server-sent event: the client reads its message
    # (it kept 'data: {"error": ...}')
    bad = GenerateParams("Hello", max_tokens=4, temperature=float("nan"))
    with pytest.raises(GenerateError) as info:
        list(stream_http(server.urls.http, bad, model=BLS))
    assert info.value.message == "temperature must be finite, got nan", info.value


def test_allotted_time_ms_and_truncation_reach_the_engine(server):
    """A request whose time is up ends timed_out through the BLS model as through the
    ensemble (tests/triton/test_generate.py), with a prefix of the greedy text; a prompt cut
    by truncate_prompt_tokens arrives cut."""
    params = GenerateParams("The capital of France is", max_tokens=2000, min_tokens=2000,
                            top_k=1, allotted_time_ms=300, cache_salt=uuid.uuid4().hex)
    [cut] = list(stream_grpc(server.urls.grpc, params, stream=False, model=BLS))
    n = cut.counts["num_output_tokens"]
    assert cut.final and cut.finish_reasons == ["timed_out"] and 0 < n < 2000
    [plain] = list(stream_grpc(server.urls.grpc, GenerateParams(
        params.prompt, max_tokens=n, min_tokens=n, top_k=1, cache_salt=params.cache_salt),
        stream=False, model=BLS))
    assert plain.text == cut.text
    # truncate_prompt_tokens (preprocessing's, through the ensemble's data flow) too
    [short] = list(stream_grpc(server.urls.grpc, GenerateParams(
        params.prompt, max_tokens=2, extra={"truncate_prompt_tokens": 5}), stream=False,
        model=BLS))
    assert short.counts["num_input_tokens"] == 5
    idle_pool(server)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_batched_request_is_answered_as_by_the_ensemble(server, stream):
    """Two prompts in one request (batch_index names each response's): per prompt, the
    ensemble's text; the final flag on the last response only."""
    salt = uuid.uuid4().hex
    params = [GenerateParams(p, max_tokens=6, min_tokens=6, top_k=1, cache_salt=salt)
              for p in ("Batched through BLS", "A second, longer prompt for the batch")]
    answers = {}
    for model in ("ensemble", BLS):
        chunks = list(stream_grpc_batch(server.urls.grpc, params, stream=stream, model=model))
        assert chunks[-1].final and not any(c.final for c in chunks[:-1]), model
        answers[model] = {b: "".join(c.text for c in chunks if c.batch_index == b)
                          for b in (0, 1)}
    assert answers[BLS] == answers["ensemble"]
    assert answers[BLS][0] != answers[BLS][1]
    idle_pool(server)


def test_a_client_that_cancels_stops_the_generation(server):
    url = server.urls.grpc
    before = idle_pool(server)
    cancelled = value(scrape(server), "suffixreplay_unfinished_requests_total",
                      reason="cancelled")
    params = GenerateParams("Once upon a", max_tokens=1500, min_tokens=1500, top_k=1,
                            cache_salt=uuid.uuid4().hex)
    chunks = stream_grpc(url, params, model=BLS)
    for _ in range(5):
        next(chunks)
    wait_until(lambda: pool_state(server)["held_by_requests"] > 0, 10, "held pages")
    chunks.close()  # the stream's cancellation: the BLS model stops hybrid_llm
    wait_until(lambda: value(scrape(server), "suffixreplay_unfinished_requests_total",
                             reason="cancelled") == cancelled + 1, 30, "the cancellation")
    after = idle_pool(server, timeout_s=30)  # well before its 1500 tokens
    assert after["free_or_cached"] == before["free_or_cached"]


def test_a_cancel_while_the_prompt_is_tokenized_stops_the_generation(server):
    """A client that cancels before the hybrid_llm request exists (a large prompt, cut by
    truncate_prompt_tokens, still being tokenized): the watcher's stop found nothing to stop
    and the request then ran to its max_tokens for a client that was gone. Now the request
    ends before it is sent, or the stop comes once it is."""
    import queue

    import tritonclient.grpc as grpcclient

    from client.generate import grpc_inputs

    cancelled = value(scrape(server), "suffixreplay_unfinished_requests_total",
                      reason="cancelled")
    logged = server.logs().count("cancelled before its generation started")
    params = GenerateParams("abcdefgh " * 300_000, max_tokens=1500, min_tokens=1500,
                            top_k=1, cache_salt=uuid.uuid4().hex,
                            extra={"truncate_prompt_tokens": 16})
    client = grpcclient.InferenceServerClient(server.urls.grpc)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer(BLS, grpc_inputs(params.fields(stream=True)))
    time.sleep(0.3)  # (tokenizing 2.7 MB takes longer)
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_until(lambda: server.logs().count("cancelled before its generation started") > logged
               or value(scrape(server), "suffixreplay_unfinished_requests_total",
                        reason="cancelled") > cancelled, 60, "the request's end")
    idle_pool(server, timeout_s=30)


def test_a_stream_runs_to_its_end_when_the_server_is_told_to_stop(tmp_path):
    """SIGTERM while a BLS stream runs: the stream finishes (the same text as without the
    signal), new requests are refused, the server exits cleanly."""
    server = launch(MODELS, LLM_PARAMS, tmp_path)
    try:
        url = server.urls.grpc
        params = GenerateParams("Once upon a", max_tokens=400, min_tokens=400, top_k=1)
        alone = "".join(c.text for c in stream_grpc(url, params, model=BLS))
        result: dict[str, object] = {}
        started = threading.Event()

        def run() -> None:
            parts = []
            try:
                for chunk in stream_grpc(url, params, model=BLS):
                    parts.append(chunk.text)
                    started.set()
            except GenerateError as exc:
                result["error"] = exc
            result["text"] = "".join(parts)

        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(60)
        server.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(GenerateError):
            list(stream_grpc(url, GenerateParams("Hi", max_tokens=2), model=BLS))
        thread.join(120)
        assert "error" not in result, result.get("error")
        assert result["text"] == alone
        assert server.wait() == 0
    finally:
        server.stop()


def test_the_openai_frontend_serves_through_it(server, tmp_path):
    """`--triton-model hybrid_llm_bls`: completions (several choices) and a streamed chat
    answer the same as through the ensemble; the model is listed under its own name."""
    import openai

    answers = {}
    for model in ("ensemble", BLS):
        with running_frontend(server, tmp_path / f"{model}.log",
                              "--triton-model", model) as url:
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
            assert [m.id for m in sdk.models.list()] == [model]
            salt = uuid.uuid4().hex
            completion = sdk.completions.create(
                model=model, prompt="The capital of France is", max_tokens=12, n=2,
                extra_body={"top_k": 1, "cache_salt": salt})
            stream = sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hello"}],
                max_tokens=16, stream=True, extra_body={"top_k": 1, "cache_salt": salt})
            chat = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            answers[model] = ([c.text for c in completion.choices],
                              completion.usage.completion_tokens, chat)
    assert answers[BLS] == answers["ensemble"]
    assert all(answers[BLS][0]) and answers[BLS][2]


def test_the_cli_generates_through_it(server):
    """`python -m client generate --model hybrid_llm_bls`, over gRPC and HTTP, prints what
    the ensemble gives; `health` lists it after the ensemble's models."""
    import subprocess
    import sys

    from client.generate import generate_http

    prompt, salt = "Write one line about the sea", uuid.uuid4().hex
    expected = generate_http(server.urls.http, GenerateParams(prompt, max_tokens=10, top_k=1,
                                                              cache_salt=salt)).text
    for transport in (["--url", server.urls.grpc],
                      ["--http", "--url", server.urls.http],
                      ["--http", "--no-stream", "--url", server.urls.http]):
        result = subprocess.run(
            [sys.executable, "-m", "client", "generate", prompt, "--model", BLS, *transport,
             "--max-tokens", "10", "--top-k", "1", "--cache-salt", salt],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected + "\n"
    for transport in (["--url", server.urls.grpc], ["--http", "--url", server.urls.http]):
        health = subprocess.run([sys.executable, "-m", "client", "health", *transport],
                                capture_output=True, text=True, timeout=120)
        assert health.returncode == 0, health.stdout + health.stderr
        assert health.stdout.splitlines()[1:] == [
            f"  {m}: ready" for m in (*LLM_MODELS, BLS)]  # the pipeline's, then the rest
