"""Guided decoding through the served ensemble (TensorRT-LLM's guided_decoding_guide_type /
guided_decoding_guide inputs): outputs follow the guide over HTTP and gRPC, streamed or not,
for every sequence of num_return_sequences, and the stream's pieces join into the same text;
a bad guide is INVALID_ARG with the grammar compiler's message, and leaks nothing."""

from __future__ import annotations

import json

import pytest
import regex

from backend.triton.server import ServerHandle
from client.generate import GenerateError, GenerateParams, generate_http, stream_grpc
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import idle_pool

PROMPT = '# settings\nuser = {"name": "alice", "age": 31}\nitem = '
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}


def guided(kind: str, guide: str | None = None, **options) -> GenerateParams:
    options.setdefault("max_tokens", 64)
    return GenerateParams(PROMPT, guide_type=kind, guide=guide, **options)


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["name", "age"], text
    assert isinstance(value["name"], str) and len(value["name"]) <= 10, text
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, text


def test_json_schema_over_http_and_grpc_streaming(llm_server: ServerHandle):
    params = guided("json_schema", json.dumps(SCHEMA), temperature=1.0, seed=5)
    text = generate_http(llm_server.urls.http, params).text
    check_schema(text)
    chunks = list(stream_grpc(llm_server.urls.grpc, params))
    # A response per step: a sampled token and the tokens the grammar forces after it
    # (jump-forward) come together.
    assert len([c for c in chunks if c.text]) >= 3
    assert "".join(c.text for c in chunks) == text
    assert sum(c.counts.get("num_output_tokens", 0) for c in chunks) == len(text.encode())


def test_regex_and_grammar_and_json(llm_server: ServerHandle):
    text = generate_http(llm_server.urls.http, guided("regex", r"[0-9]{2}-(yes|no)")).text
    assert regex.fullmatch(r"[0-9]{2}-(yes|no)", text), text
    grammar = 'root ::= "(" [a-z]+ ("," [a-z]+)* ")"'
    text = generate_http(llm_server.urls.http, guided("ebnf_grammar", grammar, seed=1,
                                                      temperature=1.0)).text
    assert regex.fullmatch(r"\([a-z]+(,[a-z]+)*\)", text), text
    text = generate_http(llm_server.urls.http, guided("json", top_k=1, max_tokens=8)).text
    assert text[:1] in ("{", "["), text


def test_every_returned_sequence_follows_the_guide(llm_server: ServerHandle):
    params = guided("json_schema", json.dumps(SCHEMA), temperature=1.0, seed=7,
                    num_return_sequences=3)
    chunk = generate_http(llm_server.urls.http, params)
    assert len(chunk.texts) == 3
    for text in chunk.texts:
        check_schema(text)


@pytest.mark.parametrize("kind, guide, message", [
    ("regex", "[a-", "guided_decoding_guide is not a valid regex: Regex parsing error"),
    ("json_schema", '{"type": "intege"}', "not a valid json_schema"),
    ("ebnf_grammar", "root ::= ", "not a valid ebnf_grammar"),
    ("yaml", "a: 1", "guided_decoding_guide_type must be one of json, json_schema, regex"),
    ("regex", None, "needs a guided_decoding_guide"),
    (None, "[0-9]+", "guided_decoding_guide is set but guided_decoding_guide_type is not"),
])
def test_bad_guides_are_invalid_arg(llm_server: ServerHandle, kind, guide, message):
    params = GenerateParams(PROMPT, max_tokens=8, guide_type=kind, guide=guide)
    with pytest.raises(GenerateError) as err:
        generate_http(llm_server.urls.http, params)
    assert err.value.status == "HTTP 400" and message in err.value.message, err.value
    with pytest.raises(GenerateError) as err:  # a gRPC stream's errors carry no status code
        list(stream_grpc(llm_server.urls.grpc, params))
    assert message in err.value.message, err.value
    assert idle_pool(llm_server)


def test_a_model_with_guided_decoding_off_refuses_guides(triton_server):
    server = triton_server(LLM_MODELS, {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"],
                                                       "guided_decoding_backend": "none"}})
    with pytest.raises(GenerateError) as err:
        generate_http(server.urls.http, guided("regex", "[0-9]+"))
    assert err.value.status == "HTTP 400" and "guided decoding is off" in err.value.message
    assert generate_http(server.urls.http, GenerateParams(PROMPT, max_tokens=4)).text
