"""Seeded random requests against the real server and frontend: each is answered with a
result or a 400 that says what was wrong (never a 500, a hang or an error inside a 200
stream), and the engine is idle with nothing held afterwards. Values are typed as the
model config says (Triton's own JSON parser answers type mismatches before any model runs)."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

from backend.triton.server import ServerHandle
from tests.triton.llm_helpers import idle_pool, running_frontend

INTS = [0, 1, 2, 3, 4, -1, -2, 7, 16, 64, 100, 259, 260, 2**31 - 1, -2**31]
FLOATS = [0.0, 0.5, 1.0, 1.5, -1.0, 2.0, 100.0, 1e-9]
STRINGS = ["", "a", "hi", "json", "regex", "ebnf_grammar", "json_schema", "structural_tag", "{",
           "[a-z]+", 'root ::= "x"', '{"type": "object"}', "x" * 300, "é😀", "\x00"]
# ensemble inputs: i int32, u uint64, f fp32, b bool, s string, ?l a list of them
ENSEMBLE = {
    "bad_words": "sl", "stop_words": "sl", "exclude_input_in_output": "b", "end_id": "i",
    "pad_id": "i", "top_k": "i", "top_p": "f", "min_p": "f", "temperature": "f",
    "length_penalty": "f", "early_stopping": "b", "repetition_penalty": "f", "min_tokens": "i",
    "no_repeat_ngram_size": "i", "presence_penalty": "f", "frequency_penalty": "f", "seed": "u",
    "return_log_probs": "b", "num_top_log_probs": "i", "return_prompt_log_probs": "b",
    "return_perf_metrics": "b", "return_context_logits": "b", "return_generation_logits": "b",
    "return_num_input_tokens": "b", "return_num_output_tokens": "b", "beam_width": "i",
    "num_return_sequences": "i", "embedding_bias_words": "sl", "embedding_bias_weights": "fl",
    "embedding_bias_token_ids": "il", "embedding_bias_token_weights": "fl",
    "retention_token_range_starts": "il", "retention_token_range_ends": "il",
    "retention_token_range_priorities": "il", "retention_token_range_durations_ms": "il",
    "retention_decode_priority": "i", "retention_decode_duration_ms": "i", "cache_salt": "s",
    "lora_name": "s", "session_id": "s", "priority": "i", "guided_decoding_guide_type": "s",
    "guided_decoding_guide": "s",
}


def _value(rng: random.Random, kind: str):
    if kind.endswith("l"):
        return [_value(rng, kind[0]) for _ in range(rng.randint(0, 3))]
    pools = {"i": INTS, "u": [0, 1, 2**63, 2**64 - 1], "f": FLOATS, "b": [True, False],
             "s": STRINGS}
    return rng.choice(pools[kind])


def _post(url: str, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _check(code: int, text: str, what) -> None:
    assert code in (200, 400, 404), (code, text[:300], what)
    if code != 200:  # a JSON error (Triton's generate_stream sends it as an SSE event)
        error = json.loads(text.removeprefix("data: "))["error"]
        assert len(error) > 0, (text, what)
    else:  # an error inside a stream (Triton's SSE or the frontend's)
        assert '"type": "error"' not in text and 'data: {"error"' not in text \
            and '"status": "failed"' not in text, (text[:300], what)


def test_random_ensemble_requests_get_an_answer_or_a_clear_error(llm_server: ServerHandle):
    rng = random.Random(2)
    codes: dict[int, int] = {}
    for _ in range(120):
        body = {"text_input": rng.choice(["hi", "Hello world, " * rng.choice([1, 5, 40]), "",
                                          "é😀 ok"]),
                "max_tokens": rng.choice([1, 2, 4, 8]),
                "cache_salt": "fuzz"}  # the shared server's default namespace left alone
        for name in rng.sample(sorted(ENSEMBLE), rng.randint(0, 8)):
            body[name] = _value(rng, ENSEMBLE[name])
        endpoint = rng.choice(["generate", "generate", "generate_stream"])
        code, text = _post(f"{llm_server.urls.http}/v2/models/ensemble/{endpoint}", body)
        _check(code, text, body)
        codes[code] = codes.get(code, 0) + 1
    assert codes.get(200, 0) >= 20 and codes.get(400, 0) >= 20, codes  # both kinds exercised
    state = idle_pool(llm_server)
    assert state["held_by_requests"] == 0 and state["active"] == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
# chat options: (mostly valid values, odd ones)
OPTIONS = {
    "stream": ([True, False], []), "temperature": ([0, 0.7], [2.5, -1]),
    "top_p": ([0.5, 1], [0, 2]), "n": ([1, 2], [0, 200]), "stop": (["\n", ["a", "b"]], [3]),
    "logprobs": ([True, False], []), "top_logprobs": ([0, 3], [21]), "seed": ([1], [-1, 2**70]),
    "presence_penalty": ([0.5], [3]), "frequency_penalty": ([-0.5], [-3]),
    "logit_bias": ([{"65": 100}], [{"999999": 1}, {"a": 1}, {"65": 101}]),
    "tool_choice": (["auto", "none", "required",
                     {"type": "function", "function": {"name": "get_time"}}],
                    [{"type": "function", "function": {"name": "nope"}}]),
    "parallel_tool_calls": ([True, False], ["x"]),
    "response_format": ([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
        [{"type": "bogus"}]),
    "stream_options": ([{"include_usage": True}], [{"include_usage": "x"}]),
    "priority": ([0, 5, -5], [1.5]), "guided_regex": (["[a-z]{2,5}"], ["("]),
    "min_tokens": ([2], [100]), "no_repeat_ngram_size": ([2], [-1]), "top_k": ([1], [-2]),
    "min_p": ([0.1], [2]), "repetition_penalty": ([1.2], [0]), "echo": ([False], [True]),
}


def _chat(rng: random.Random) -> dict:
    messages = [{"role": "user", "content": rng.choice(
        ["hi", "Weather in Oslo?", [{"type": "text", "text": "hey"}], ""])}]
    if rng.random() < 0.3:
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "get_time", "arguments": rng.choice(["{}", "{bad", "[1]"])}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    body = {"model": "ensemble", "messages": messages, "max_tokens": rng.choice([1, 4, 16]),
            "cache_salt": "fuzz"}
    for name in rng.sample(sorted(OPTIONS), rng.randint(0, 6)):
        good, odd = OPTIONS[name]
        body[name] = rng.choice(odd if odd and rng.random() < 0.25 else good)
    if "tool_choice" in body or rng.random() < 0.2:
        body["tools"] = [WEATHER, CLOCK]
    if "stream_options" in body:
        body["stream"] = True
    return body


def _request(rng: random.Random) -> tuple[str, dict | bytes]:
    kind = rng.choice(["chat", "chat", "chat", "completions", "responses", "raw"])
    if kind == "chat":
        return "/v1/chat/completions", _chat(rng)
    if kind == "completions":
        body = {k: v for k, v in _chat(rng).items()
                if k not in ("messages", "tools", "tool_choice", "parallel_tool_calls")}
        body["prompt"] = rng.choice(["hi", ["a", "b"], [1, 2, 3], "", [999999], "x" * 3000])
        return "/v1/completions", body
    if kind == "responses":
        return "/v1/responses", {
            "model": "ensemble", "input": rng.choice(["hi", [{"role": "user", "content": "hi"}]]),
            "max_output_tokens": rng.choice([4, 16, 0]), "stream": rng.choice([True, False]),
            "tools": rng.choice([[], [{"type": "function", "name": "get_time"}]])}
    return (rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/responses"]),
            rng.choice([b"{", b"[]", b"null", b"\xff\xfe", b'{"model": "ensemble"}']))


def test_random_openai_requests_get_an_answer_or_a_clear_error(llm_server: ServerHandle,
                                                                tmp_path):
    rng = random.Random(5)
    codes: dict[int, int] = {}
    with running_frontend(llm_server, tmp_path / "frontend.log",
                          "--served-model-name", "ensemble") as url:
        for _ in range(120):
            path, body = _request(rng)
            code, text = _post(url + path, body)
            _check(code, text, (path, body))
            codes[code] = codes.get(code, 0) + 1
    assert codes.get(200, 0) >= 20 and codes.get(400, 0) >= 20, codes
    state = idle_pool(llm_server)
    assert state["held_by_requests"] == 0 and state["active"] == 0
