"""Bad requests get a clear error naming what was wrong, and leave the server healthy with
nothing leaked (HTTP status 400 is Triton's INVALID_ARG)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from backend.triton.server import ServerHandle
from client.generate import GenerateError, GenerateParams, generate_http, stream_grpc
from tests.triton.llm_helpers import idle_pool

# (id, JSON body for /v2/models/ensemble/generate, what the error must say)
HTTP_CASES = [
    ("missing_text_input", {"max_tokens": 8}, "missing required input(s) ['text_input']"),
    ("empty_prompt", {"text_input": "", "max_tokens": 8}, "empty"),
    ("prompt_over_context", {"text_input": "x" * 2100, "max_tokens": 8}, "context limit of 2048"),
    ("max_tokens_zero", {"text_input": "hi", "max_tokens": 0}, "max_tokens) must be >= 1"),
    ("max_tokens_negative", {"text_input": "hi", "max_tokens": -5}, "max_tokens) must be >= 1"),
    ("max_tokens_huge", {"text_input": "hi", "max_tokens": 2**31 - 1}, "max_tokens must be in"),
    ("max_tokens_over_context", {"text_input": "hi", "max_tokens": 4000}, "context limit"),
    ("temperature_nan", {"text_input": "hi", "max_tokens": 4, "temperature": float("nan")},
     "temperature must be finite"),
    ("temperature_inf", {"text_input": "hi", "max_tokens": 4, "temperature": float("inf")},
     "temperature must be finite"),
    ("top_p_zero", {"text_input": "hi", "max_tokens": 4, "top_p": 0.0}, "top_p must be in (0, 1]"),
    ("top_p_above_one", {"text_input": "hi", "max_tokens": 4, "top_p": 1.5},
     "top_p must be in (0, 1]"),
    ("top_k_negative", {"text_input": "hi", "max_tokens": 4, "top_k": -1}, "top_k must be >= 0"),
    ("min_p_above_one", {"text_input": "hi", "max_tokens": 4, "min_p": 1.5},
     "min_p must be in [0, 1], got 1.5"),
    ("min_over_max", {"text_input": "hi", "max_tokens": 4, "min_tokens": 9}, "min_tokens must"),
    ("wrong_shape", {"text_input": ["a", "b"], "max_tokens": 4}, "batch size does not match"),
    ("beam_search_top_p", {"text_input": "hi", "max_tokens": 4, "beam_width": 2, "top_p": 0.5},
     "do not apply to beam search"),
    ("repetition_penalty_zero", {"text_input": "hi", "max_tokens": 4, "repetition_penalty": 0.0},
     "repetition_penalty must be finite and > 0"),
    ("presence_penalty_inf",
     {"text_input": "hi", "max_tokens": 4, "presence_penalty": float("inf")},
     "presence_penalty must be finite"),
    ("bias_weights_mismatch", {"text_input": "hi", "max_tokens": 4,
                               "embedding_bias_words": ["a", "b"], "embedding_bias_weights": [1.0]},
     "does not match"),
    ("allowed_outside_vocab", {"text_input": "hi", "max_tokens": 4,
                               "allowed_token_ids": [97, 999]},
     "allowed_token_ids holds token ids [999] outside the vocabulary [0, 260)"),
    ("allowed_with_guide", {"text_input": "hi", "max_tokens": 4, "allowed_token_ids": [97],
                            "guided_decoding_guide_type": "regex",
                            "guided_decoding_guide": "a+"},
     "allowed_token_ids and guided decoding do not combine"),
    ("end_id_outside_vocab", {"text_input": "hi", "max_tokens": 4, "end_id": 999},
     "end_id=999 is outside the vocabulary [0, 260)"),
    ("end_id_negative", {"text_input": "hi", "max_tokens": 4, "end_id": -2},
     "end_id=-2 is outside the vocabulary"),
    ("top_log_probs_21", {"text_input": "hi", "max_tokens": 4, "num_top_log_probs": 21},
     "num_top_log_probs must be in [0, 20], got 21"),
    ("no_repeat_ngram_negative", {"text_input": "hi", "max_tokens": 4,
                                  "no_repeat_ngram_size": -1},
     "no_repeat_ngram_size must be >= 0, got -1"),
    ("bias_token_id_outside_vocab", {"text_input": "hi", "max_tokens": 4,
                                     "embedding_bias_token_ids": [3, 260],
                                     "embedding_bias_token_weights": [1.0, 1.0]},
     "outside the vocabulary (0..259): [260]"),
    # an adapter's namespace is "<salt>\x00lora:<name>": a salt must not spell one
    ("cache_salt_nul", {"text_input": "hi", "max_tokens": 4, "cache_salt": "\x00lora:math"},
     "cache_salt must not contain NUL characters"),
]  # fmt: skip


def post_generate(server: ServerHandle, body: bytes, model: str = "ensemble") -> tuple[int, str]:
    request = urllib.request.Request(
        f"{server.urls.http}/v2/models/{model}/generate", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


@pytest.fixture(scope="module")
def baseline(llm_server: ServerHandle) -> dict[str, float]:
    return idle_pool(llm_server)


@pytest.mark.parametrize(("body", "expected"), [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])  # fmt: skip
def test_bad_http_request_is_invalid_arg(llm_server, baseline, body, expected):
    status, message = post_generate(llm_server, json.dumps(body).encode())
    assert status == 400, message
    assert expected in message
    assert llm_server.is_ready()


def test_invalid_utf8_prompt(llm_server, baseline):
    status, message = post_generate(llm_server, b'{"text_input": "ab\xff\xfe", "max_tokens": 4}')
    assert status == 400
    assert "not valid UTF-8: byte 0xff at offset 2" in message


def test_unknown_model(llm_server, baseline):
    # Triton answers this itself, with NOT_FOUND (HTTP 404) rather than INVALID_ARG.
    status, message = post_generate(llm_server, b'{"text_input": "hi", "max_tokens": 4}', "nope")
    assert status == 404
    assert "unknown model" in message and "nope" in message


def test_bad_grpc_stream_requests(llm_server, baseline):
    cases = [
        (
            {"max_tokens": np.array([[4.0]], dtype=np.float32)},
            "data-type is 'FP32', but model 'ensemble' expects 'INT32'",
        ),
        ({"text_input": np.array([[b"\xc3("]], dtype=np.object_)}, "not valid UTF-8"),
        ({"temperature": np.array([[np.nan]], dtype=np.float32)}, "temperature must be finite"),
        ({"top_p": np.array([[2.0]], dtype=np.float32)}, "top_p must be in (0, 1]"),
    ]
    for extra, expected in cases:
        params = GenerateParams("hello", max_tokens=4, extra=extra)
        with pytest.raises(GenerateError) as info:
            list(stream_grpc(llm_server.urls.grpc, params))
        assert expected in info.value.message, (extra, info.value.message)


def test_server_healthy_and_nothing_leaked_after_bad_input(llm_server, baseline):
    # Runs last in this module: every bad request above has been answered.
    good = generate_http(llm_server.urls.http, GenerateParams("still fine", max_tokens=4))
    assert good.counts["num_output_tokens"] >= 1
    after = idle_pool(llm_server)
    assert after["held_by_requests"] == baseline["held_by_requests"] == 0
    assert after["free_or_cached"] == baseline["free_or_cached"]
    assert after["active"] == 0
