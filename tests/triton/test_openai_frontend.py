"""The OpenAI-compatible frontend (`python -m backend.openai_api`, a real process) in front of a
real tritonserver, driven by the OpenAI SDK: the same text as Triton's own endpoints, streamed
or not; stop strings; several prompts and choices; usage with cached tokens; guided JSON; tool
calls (named, required, auto) and a tool's result fed back; clear errors; a client that goes
away cancels its request and leaves no page held."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from backend.triton.server import ServerHandle
from client.generate import GenerateParams, generate_http
from tests.triton.llm_helpers import (
    idle_pool,
    long_prompt,
    pool_state,
    running_frontend,
    scrape,
    value,
    wait_until,
)

PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def frontend(llm_server: ServerHandle, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("openai") / "frontend.log"
    with running_frontend(llm_server, log, "--served-model-name", "ensemble",
                          "--served-model-name", "tiny-qwen3.5") as url:
        yield url


@pytest.fixture(scope="module")
def sdk(frontend: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def greedy(**extra) -> dict:
    """Every request yields exactly MAX_TOKENS tokens, whatever the model (min_tokens)."""
    body = {"top_k": 1, "min_tokens": MAX_TOKENS, "cache_salt": uuid.uuid4().hex}
    body.update(extra)
    return body


def post(frontend: str, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(frontend + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_are_listed_under_their_served_names(sdk: openai.OpenAI):
    assert [m.id for m in sdk.models.list()] == ["ensemble", "tiny-qwen3.5"]
    model = sdk.models.retrieve("tiny-qwen3.5")
    assert model.id == "tiny-qwen3.5" and model.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.models.retrieve("gpt-4")


def test_health_ping_and_version_answer_as_vllms(frontend: str):
    """vLLM's GET /health and SageMaker's /ping (GET and POST): 200, empty body, while Triton
    serves; GET /version: the installed package's version."""
    from importlib.metadata import version

    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        request = urllib.request.Request(frontend + path, method=method,
                                         data=b"" if method == "POST" else None)
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert (resp.status, resp.read()) == (200, b""), path
    with urllib.request.urlopen(frontend + "/version", timeout=30) as resp:
        assert json.loads(resp.read()) == {"version": version("suffixreplay")}


def test_completion_equals_tritons_generate(sdk: openai.OpenAI, llm_server: ServerHandle):
    extra = greedy()
    reply = sdk.completions.create(model="tiny-qwen3.5", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                   extra_body=extra)
    triton = generate_http(llm_server.urls.http, GenerateParams(
        PROMPT, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1,
        cache_salt=extra["cache_salt"]))
    [choice] = reply.choices
    assert choice.text == triton.text and choice.finish_reason == "length"
    assert reply.object == "text_completion" and reply.model == "tiny-qwen3.5"
    assert reply.usage.prompt_tokens == len(PROMPT.encode())  # one byte token each
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.usage.total_tokens == len(PROMPT.encode()) + MAX_TOKENS
    echoed = sdk.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    echo=True, extra_body=extra)
    assert echoed.choices[0].text == PROMPT + triton.text


def test_logit_bias_steers_the_tokens(sdk: openai.OpenAI):
    """OpenAI's logit_bias (token id -> bias) is added to the logits, greedy included."""
    plain = sdk.completions.create(model="tiny-qwen3.5", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                   extra_body=greedy()).choices[0].text
    forced = sdk.completions.create(model="tiny-qwen3.5", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    logit_bias={str(ord("Z")): 100}, extra_body=greedy())
    assert forced.choices[0].text == "Z" * MAX_TOKENS != plain
    common = max((c for c in plain if c.isascii()), key=plain.count)  # banned: the plain
    # answer's commonest byte
    banned = sdk.chat.completions.create(
        model="tiny-qwen3.5", messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS, logit_bias={str(ord(common)): -100}, stream=True,
        extra_body=greedy())
    text = "".join(c.choices[0].delta.content or "" for c in banned if c.choices)
    assert text and common not in text


def test_no_repeat_ngram_size_is_passed_on(sdk: openai.OpenAI, llm_server: ServerHandle):
    extra = greedy(no_repeat_ngram_size=2)
    reply = sdk.completions.create(model="tiny-qwen3.5", prompt=PROMPT * 2,
                                   max_tokens=MAX_TOKENS, extra_body=extra)
    triton = generate_http(llm_server.urls.http, GenerateParams(
        PROMPT * 2, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1,
        no_repeat_ngram_size=2, cache_salt=extra["cache_salt"]))
    plain = generate_http(llm_server.urls.http, GenerateParams(
        PROMPT * 2, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1,
        cache_salt=uuid.uuid4().hex))
    assert reply.choices[0].text == triton.text != plain.text


def test_streamed_chat_equals_the_whole_answer(sdk: openai.OpenAI):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is machine learning?"}]
    extra = greedy()
    whole = sdk.chat.completions.create(model="ensemble", messages=messages,
                                        max_tokens=MAX_TOKENS, extra_body=extra)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and whole.object == "chat.completion"
    events = list(sdk.chat.completions.create(
        model="ensemble", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra,
        stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"  # the role comes first
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    reasons = [e.choices[0].finish_reason for e in events if e.choices]
    assert text == choice.message.content
    assert reasons[-1] == choice.finish_reason == "length" and not any(reasons[:-1])
    usage = events[-1].usage  # the usage chunk, without choices, last
    assert not events[-1].choices and usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens == whole.usage.prompt_tokens > len("What is machine learning?")
    assert all(e.usage is None for e in events[:-1])
    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    counted = list(sdk.chat.completions.create(
        model="ensemble", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert "".join(e.choices[0].delta.content or "" for e in counted if e.choices) == text
    so_far = [e.usage.completion_tokens for e in counted]
    assert so_far == sorted(so_far) and so_far[-1] == MAX_TOKENS
    assert len(set(so_far)) > 2  # it grows as the tokens come
    assert all(e.usage.prompt_tokens == usage.prompt_tokens for e in counted[1:])
    assert all(e.usage.total_tokens == e.usage.prompt_tokens + e.usage.completion_tokens
               for e in counted)


def test_stop_strings_end_the_text_before_them(sdk: openai.OpenAI):
    extra = greedy()
    kwargs = dict(model="ensemble", prompt="Stop strings:", max_tokens=MAX_TOKENS)
    text = sdk.completions.create(**kwargs, extra_body=extra).choices[0].text
    stop = text[4:6]  # two characters: the frontend must hold one back while streaming
    expected = text[:text.index(stop)]
    extra = greedy(min_tokens=0, cache_salt=extra["cache_salt"])
    cut = sdk.completions.create(**kwargs, stop=[stop], extra_body=extra).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop"
    pieces = [(e.choices[0].text, e.choices[0].finish_reason) for e in
              sdk.completions.create(**kwargs, stop=stop, stream=True, extra_body=extra)]
    streamed = ""
    for piece, _ in pieces:
        streamed += piece
        assert stop not in streamed  # never sent, not even in part and taken back
    assert streamed == expected and pieces[-1][1] == "stop"


def test_completion_logprobs_are_the_engines(sdk: openai.OpenAI, llm_server: ServerHandle,
                                             frontend: str):
    """logprobs = 3 on a seeded sampled completion: each returned token with Triton's own
    log probability of it and its three likeliest alternatives (the token itself added to
    each dict), offsets into the text; the stream's tokens are the same ones; with vLLM's
    return_tokens_as_token_ids the same tokens by id."""
    extra = {"seed": 3, "min_tokens": MAX_TOKENS, "cache_salt": uuid.uuid4().hex}
    kwargs = dict(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0)
    reply = sdk.completions.create(**kwargs, logprobs=3, extra_body=extra).choices[0]
    triton = generate_http(llm_server.urls.http, GenerateParams(
        PROMPT, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=1.0, seed=3,
        num_top_log_probs=3, cache_salt=extra["cache_salt"]))
    lp = reply.logprobs
    assert reply.text == triton.text and len(lp.tokens) == MAX_TOKENS
    assert lp.token_logprobs == pytest.approx(triton.log_probs, abs=1e-5)
    names = [[chr(t) if t < 128 else None for t in triton.top_log_prob_ids[i:i + 3]]
             for i in range(0, 3 * MAX_TOKENS, 3)]
    for i, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        assert top[token] == pytest.approx(lp.token_logprobs[i])  # the token is in its dict
        want = {n: v for n, v in zip(names[i], triton.top_log_probs[3 * i:3 * i + 3]) if n}
        assert {n: top[n] for n in want} == pytest.approx(want, abs=1e-5)
        assert len(top) in (3, 4)  # the three likeliest, and the token where it is not one
    def raw(token: str) -> bytes:  # a token's bytes back from its name
        if token.startswith("bytes:"):
            return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
        return token.encode()

    assert b"".join(map(raw, lp.tokens)) == reply.text.encode()
    starts = [len(b"".join(map(raw, lp.tokens[:i])).decode(errors="ignore"))
              for i in range(MAX_TOKENS)]
    assert lp.text_offset == starts  # where each token's text starts (a split character: its)
    streamed = [(t, v) for e in sdk.completions.create(**kwargs, logprobs=3, stream=True,
                                                     extra_body=extra)
                for c in e.choices if c.logprobs for t, v in zip(c.logprobs.tokens,
                                                                  c.logprobs.token_logprobs)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs))
    plain = sdk.completions.create(**kwargs, extra_body=extra).choices[0]
    assert plain.logprobs is None and plain.text == reply.text
    # vLLM's return_tokens_as_token_ids: the same tokens named "token_id:N", ids whose text
    # is the reply's, alternatives too.
    by_id = sdk.completions.create(**kwargs, logprobs=3, extra_body={
        **extra, "return_tokens_as_token_ids": True}).choices[0]
    assert by_id.text == reply.text
    assert by_id.logprobs.token_logprobs == lp.token_logprobs
    ids = [int(t.removeprefix("token_id:")) for t in by_id.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in by_id.logprobs.tokens)
    status, text = post(frontend, "/detokenize", {"model": "ensemble", "tokens": ids})
    assert status == 200 and text["prompt"] == reply.text
    for top, want in zip(by_id.logprobs.top_logprobs, triton.top_log_prob_ids.reshape(-1, 3)):
        assert {f"token_id:{t}" for t in want.tolist()} <= set(top)


def test_echo_with_logprobs_scores_the_prompt(sdk: openai.OpenAI, llm_server: ServerHandle):
    """echo + logprobs (how evaluation harnesses score a text, lm-eval's loglikelihood): the
    prompt's tokens come first, the first with null, each other with Triton's prompt log
    probability and its alternatives, then the generated ones; the same streamed."""
    prompt = "Paris is the capital of France."
    kwargs = dict(model="ensemble", prompt=prompt, max_tokens=1, temperature=0.0, echo=True,
                  logprobs=2, extra_body={"cache_salt": uuid.uuid4().hex})
    choice = sdk.completions.create(**kwargs).choices[0]
    triton = generate_http(llm_server.urls.http, GenerateParams(
        prompt, max_tokens=1, top_k=1, num_top_log_probs=2, return_prompt_log_probs=True))
    lp, P = choice.logprobs, len(prompt)  # one byte token a character
    assert choice.text.startswith(prompt) and len(lp.tokens) == P + 1
    assert "".join(lp.tokens[:P]) == prompt and lp.text_offset == list(range(P + 1))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:P] == pytest.approx(triton.prompt_log_probs.tolist(), abs=1e-5)
    alternatives = triton.prompt_top_log_prob_ids.reshape(P - 1, 2)
    for i in range(1, P):
        names = {chr(t) for t in alternatives[i - 1] if t < 128}
        assert names <= set(lp.top_logprobs[i]) and lp.tokens[i] in lp.top_logprobs[i]
    assert lp.token_logprobs[P] == pytest.approx(triton.log_probs[0], abs=1e-5)
    streamed = [(t, v) for e in sdk.completions.create(**kwargs, stream=True)
                for c in e.choices if c.logprobs
                for t, v in zip(c.logprobs.tokens, c.logprobs.token_logprobs)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs))


def test_prompt_logprobs_are_vllms(frontend: str, llm_server: ServerHandle):
    """vLLM's prompt_logprobs: null for the first prompt token, then per token a dict from
    token id to {logprob, rank, decoded_token}: the prompt's token (Triton's log probability
    and rank), then the position's N likeliest (ranks 1..N); on each completion choice, on a
    chat answer; generated logprobs keep their own count; not with stream (400)."""
    prompt = "Paris is the capital of France."
    salt = uuid.uuid4().hex
    triton = generate_http(llm_server.urls.http, GenerateParams(
        prompt, max_tokens=1, top_k=1, num_top_log_probs=3, return_prompt_log_probs=True,
        cache_salt=salt))
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": 2, "n": 2, "logprobs": 1,
            "prompt_logprobs": 3, "top_k": 1, "cache_salt": salt}
    status, answer = post(frontend, "/v1/completions", body)
    assert status == 200, answer
    P = len(prompt)  # one byte token a character
    ids = triton.prompt_top_log_prob_ids.reshape(P - 1, 3)
    values = triton.prompt_top_log_probs.reshape(P - 1, 3)
    for choice in answer["choices"]:
        scores = choice["prompt_logprobs"]
        assert len(scores) == P and scores[0] is None
        for i, entry in enumerate(scores[1:]):
            token = prompt.encode()[i + 1]
            first = next(iter(entry))  # the prompt's token first
            assert first == str(token) and entry[first]["decoded_token"] == chr(token)
            assert entry[first]["logprob"] == pytest.approx(triton.prompt_log_probs[i], abs=1e-5)
            assert entry[first]["rank"] == triton.prompt_log_prob_ranks[i] >= 1
            for rank, (t, v) in enumerate(zip(ids[i], values[i]), start=1):
                assert entry[str(t)]["logprob"] == pytest.approx(float(v), abs=1e-5)
                assert entry[str(t)]["rank"] == (rank if t != token else entry[first]["rank"])
            assert len(entry) == 3 + (triton.prompt_log_prob_ranks[i] > 3)
        # the generated tokens' alternatives: logprobs=1 (the token and at most one other)
        assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    assert any(e[next(iter(e))]["rank"] > 3 for e in answer["choices"][0]["prompt_logprobs"][1:])
    chat = {"model": "ensemble", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "prompt_logprobs": 0, "cache_salt": salt}
    status, answer = post(frontend, "/v1/chat/completions", chat)
    assert status == 200, answer
    scores = answer["prompt_logprobs"]
    assert scores[0] is None and len(scores) == answer["usage"]["prompt_tokens"] > 2
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in scores[1:])
    assert "logprobs" not in answer["choices"][0] or answer["choices"][0]["logprobs"] is None
    for bad, message in (({**body, "stream": True}, "not available with 'stream': true"),
                         ({**body, "prompt_logprobs": 21}, "'prompt_logprobs' must be from 0"),
                         ({**body, "prompt_logprobs": -1}, "'prompt_logprobs' must be from 0")):
        status, error = post(frontend, "/v1/completions", bad)
        assert status == 400 and message in error["error"]["message"], error
    status, error = post(frontend, "/v1/responses", {"model": "ensemble", "input": "Hi",
                                                     "prompt_logprobs": 1})
    assert status == 400 and "'prompt_logprobs' is not supported" in error["error"]["message"]


def test_use_beam_search_returns_the_ensembles_beams(frontend: str, sdk: openai.OpenAI,
                                                     llm_server: ServerHandle):
    """vLLM's use_beam_search: the n choices are the ensemble's beam_width = n beams, best
    first (length_penalty passed on), streamed or not; one wide it is greedy decoding; beam
    options without it, or alternatives with it, are a 400."""
    prompt = "def fact(n):\n"
    salt = uuid.uuid4().hex
    ensemble = {}
    for penalty in (1.0, 0.0):  # the stop string "\n": beams of different lengths
        ensemble[penalty] = generate_http(llm_server.urls.http, GenerateParams(
            prompt, max_tokens=16, beam_width=3, length_penalty=penalty, return_log_probs=True,
            stop_words=("\n",), cache_salt=salt))
    assert ensemble[1.0].texts != ensemble[0.0].texts  # the penalty reaches the search
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": 16, "n": 3, "logprobs": 0,
            "use_beam_search": True, "stop": ["\n"], "cache_salt": salt}
    for penalty, want in ensemble.items():
        status, answer = post(frontend, "/v1/completions", {**body, "length_penalty": penalty})
        assert status == 200, answer
        # the text before the stop string, and its tokens (one a byte)
        cut = [t.split("\n")[0] for t in want.texts]
        assert [c["text"] for c in answer["choices"]] == cut
        sums = [sum(c["logprobs"]["token_logprobs"]) for c in answer["choices"]]
        assert sums == pytest.approx([sum(row[:len(t.encode())]) for row, t in
                                      zip(want.log_probs_by_sequence, cut)], abs=1e-3)
        assert answer["usage"]["completion_tokens"] == want.counts["num_output_tokens"]
    texts = ["", "", ""]
    for chunk in sdk.completions.create(model="ensemble", prompt=prompt, max_tokens=16, n=3,
                                        stop=["\n"], stream=True,
                                        extra_body={"use_beam_search": True,
                                                    "cache_salt": salt}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [t.split("\n")[0] for t in ensemble[1.0].texts]
    one = {"model": "ensemble", "prompt": prompt, "max_tokens": 12, "cache_salt": salt}
    beam_one = post(frontend, "/v1/completions", {**one, "use_beam_search": True})[1]
    plain = post(frontend, "/v1/completions", {**one, "top_k": 1})[1]
    assert beam_one["choices"][0]["text"] == plain["choices"][0]["text"]
    for bad, message in (
            ({"length_penalty": 0.5}, "'length_penalty' only applies with 'use_beam_search'"),
            ({"early_stopping": True}, "'early_stopping' only applies with 'use_beam_search'"),
            ({"use_beam_search": True, "n": 2, "logprobs": 2}, "top_log_probs with beam search")):
        status, error = post(frontend, "/v1/completions", {**one, **bad})
        assert status == 400 and message in error["error"]["message"], error
    idle_pool(llm_server)


def test_skip_special_tokens_false_writes_them(sdk: openai.OpenAI, frontend: str):
    """vLLM's skip_special_tokens false: special tokens the model generates are written in the
    text (streamed or not; default: left out), but a special stop token that ended a choice
    is not: a stop_token_ids one, or the chat template's turn end."""
    start, end = 257, 258  # <|im_start|>, <|im_end|> (the template's turn end)
    base = {"model": "ensemble", "prompt": "Specials:", "max_tokens": 3,
            "logit_bias": {str(start): 100}, "cache_salt": uuid.uuid4().hex}
    status, plain = post(frontend, "/v1/completions", base)
    assert status == 200 and plain["choices"][0]["text"] == "", plain
    status, kept = post(frontend, "/v1/completions", {**base, "skip_special_tokens": False})
    assert status == 200 and kept["choices"][0]["text"] == "<|im_start|>" * 3, kept
    for spaces in (True, False):  # vLLM's option, either way a fast tokenizer's joining
        status, joined = post(frontend, "/v1/completions", {
            **base, "skip_special_tokens": False, "spaces_between_special_tokens": spaces})
        assert status == 200 and joined["choices"][0]["text"] == "<|im_start|>" * 3, joined
    streamed = sdk.completions.create(
        model="ensemble", prompt="Specials:", max_tokens=3, stream=True, logit_bias={
            str(start): 100}, extra_body={"skip_special_tokens": False, "n": 2, "seed": 1})
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == ["<|im_start|>" * 3] * 2
    status, beams = post(frontend, "/v1/completions", {**base, "skip_special_tokens": False,
                                                        "use_beam_search": True, "n": 2})
    assert status == 200 and beams["choices"][0]["text"] == "<|im_start|>" * 3, beams
    status, stopped = post(frontend, "/v1/completions", {**base, "skip_special_tokens": False,
                                                          "stop_token_ids": [start]})
    choice = stopped["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == \
        ("", "stop", start), stopped
    # a stop string that is a special token's text: the engine stops at the token; its
    # stop_reason is the string, and with the token written the stop filter cuts it
    for extra, text in (({}, ""), ({"skip_special_tokens": False}, ""),
                        ({"skip_special_tokens": False, "include_stop_str_in_output": True},
                         "<|im_start|>")):
        status, cut = post(frontend, "/v1/completions",
                           {**base, "stop": ["<|im_start|>"], **extra})
        choice = cut["choices"][0]
        assert (choice["text"], choice["stop_reason"]) == (text, "<|im_start|>"), (extra, cut)
    status, chat = post(frontend, "/v1/chat/completions", {
        "model": "ensemble", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4, "logit_bias": {str(end): 100}, "skip_special_tokens": False})
    answer = chat["choices"][0]
    assert status == 200 and answer["message"]["content"] == "", chat
    assert answer["finish_reason"] == "stop"


def test_vllm_text_options_reach_the_engine(sdk: openai.OpenAI, frontend: str):
    """vLLM's stop_token_ids (the generation ends on the token, which stays in the text),
    include_stop_str_in_output, bad_words and guided_choice, against the same greedy
    completion without them; stop_reason names the stop string or token that ended it."""
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    base = {"model": "ensemble", "prompt": prompt, "max_tokens": 24, "top_k": 1,
            "cache_salt": uuid.uuid4().hex}

    def complete(**extra) -> dict:
        status, answer = post(frontend, "/v1/completions", {**base, **extra})
        assert status == 200, answer
        return answer["choices"][0]

    first = complete()
    plain = first["text"]
    assert first["finish_reason"] == "length" and first["stop_reason"] is None
    cut = len(plain) // 2
    token = plain[cut]  # a character (one byte token) half way: the first time it appears
    ended = complete(stop_token_ids=[ord(token)])
    assert ended["text"] == plain[:plain.index(token) + 1] and ended["finish_reason"] == "stop"
    assert ended["stop_reason"] == ord(token)  # vLLM's: the token id it ended on
    stop = plain[cut:cut + 3]
    at_string = complete(stop=[stop, "never there"])
    assert at_string["text"] == plain[:plain.index(stop)] and at_string["stop_reason"] == stop
    kept = complete(stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == plain[:plain.index(stop) + 3] and kept["finish_reason"] == "stop"
    streamed = [c for chunk in sdk.completions.create(
        model="ensemble", prompt=prompt, max_tokens=24, stream=True,
        extra_body={"top_k": 1, "cache_salt": base["cache_salt"],
                    "stop_token_ids": [ord(token)]}) for c in chunk.choices]
    assert "".join(c.text for c in streamed) == ended["text"]
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in streamed
            if c.finish_reason] == [("stop", ord(token))]  # on the last chunk only
    assert all("stop_reason" not in c.model_extra for c in streamed if not c.finish_reason)
    # a special token writes no text: its id is still the stop_reason (257: <|im_start|>)
    special = complete(stop_token_ids=[257], logit_bias={"257": 100})
    assert (special["finish_reason"], special["stop_reason"]) == ("stop", 257), special
    digits = complete(allowed_token_ids=[ord(c) for c in "0123456789 "])
    assert digits["text"] and set(digits["text"]) <= set("0123456789 "), digits
    for bad, message in (([ord("a"), 999], "outside the vocabulary"),
                         ([ord("a")], "do not combine")):
        extra = {"guided_regex": "[a-z]+"} if message == "do not combine" else {}
        status, answer = post(frontend, "/v1/completions",
                              {**base, "allowed_token_ids": bad, **extra})
        assert status == 400 and message in answer["error"]["message"], answer
    word = plain.split()[0]
    assert word not in complete(bad_words=[word])["text"]
    for choices in (["yes", "no"], ["def fib", 'say "hi"\n']):
        assert complete(guided_choice=choices, max_tokens=12)["text"] in choices
        assert complete(structured_outputs={"choice": choices}, max_tokens=12)["text"] in choices
    assert complete(structured_outputs={"regex": "[0-9]{5}"}, max_tokens=12)["text"].isdigit()
    status, error = post(frontend, "/v1/completions", {**base, "stop_token_ids": [10**7]})
    assert status == 400 and "outside the vocabulary" in error["error"]["message"]


def test_a_prediction_changes_the_time_not_the_answer(sdk: openai.OpenAI, frontend: str):
    """OpenAI's predicted outputs: the same answer with the prediction (exact, edited or a
    list of text parts), its draft tokens kept and rejected in usage's
    completion_tokens_details; a malformed one is a 400."""
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    extra = {"top_k": 1, "cache_salt": uuid.uuid4().hex}
    kwargs = dict(model="ensemble", messages=messages, max_tokens=40, extra_body=extra)
    plain = sdk.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction: not reported
    edited = text[:10] + "EDIT" + text[14:]
    for prediction in (text, edited, [{"type": "text", "text": text[:20]},
                                      {"type": "text", "text": text[20:]}]):
        answer = sdk.chat.completions.create(
            **kwargs, prediction={"type": "content", "content": prediction})
        assert answer.choices[0].message.content == text
        details = answer.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.rejected_prediction_tokens >= 0
    streamed = sdk.chat.completions.create(**kwargs, stream=True,
                                           prediction={"type": "content", "content": text})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    for bad in ({"type": "content"}, {"type": "other", "content": "x"}, "x"):
        status, error = post(frontend, "/v1/chat/completions",
                             {"model": "ensemble", "messages": messages, "prediction": bad})
        assert status == 400 and "'prediction' must be" in error["error"]["message"]


def test_chat_logprobs_cover_the_answer_only(sdk: openai.OpenAI):
    """Chat logprobs: the tokens' bytes join to the answer (the turn end the template stops
    at is not one of them), each with top_logprobs alternatives, likeliest first, streamed
    too; a stop string cuts the tokens where it cuts the text."""
    messages = [{"role": "user", "content": "Say something short."}]
    extra = greedy(min_tokens=0)
    kwargs = dict(model="ensemble", messages=messages, max_tokens=48, logprobs=True,
                  top_logprobs=2, extra_body=extra)
    choice = sdk.chat.completions.create(**kwargs).choices[0]
    content = choice.logprobs.content
    assert b"".join(bytes(t.bytes) for t in content) == choice.message.content.encode()
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token  # greedy: the likeliest
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    streamed = [t for e in sdk.chat.completions.create(**kwargs, stream=True)
                for c in e.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    text = choice.message.content
    if len(text) < 6:
        pytest.skip(f"the answer {text!r} is too short to cut")
    stop = text[3:5]
    cut = sdk.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.message.content == text[:text.index(stop)]
    kept = b"".join(bytes(t.bytes) for t in cut.logprobs.content)
    assert kept == cut.message.content.encode()
    pieces = list(sdk.chat.completions.create(**kwargs, stop=[stop], stream=True))
    tokens = [t for e in pieces for c in e.choices if c.logprobs for t in c.logprobs.content]
    assert b"".join(bytes(t.bytes) for t in tokens) == kept


def test_token_id_prompts_equal_their_text(sdk: openai.OpenAI):
    """Prompts as token ids (one list, or a list of lists, as evaluation harnesses send
    them) answer as their text does, usage counting those ids."""
    extra = greedy()
    texts = ["Token ids in", "and more ids"]
    want = [sdk.completions.create(model="ensemble", prompt=t, max_tokens=MAX_TOKENS,
                                   extra_body=extra).choices[0].text for t in texts]
    ids = [list(t.encode()) for t in texts]  # the byte tokenizer: one id a byte
    one = sdk.completions.create(model="ensemble", prompt=ids[0], max_tokens=MAX_TOKENS,
                                 extra_body=extra)
    assert one.choices[0].text == want[0] and one.usage.prompt_tokens == len(ids[0])
    both = sdk.completions.create(model="ensemble", prompt=ids, max_tokens=MAX_TOKENS,
                                  echo=True, extra_body=extra)
    assert [c.text for c in both.choices] == [t + w for t, w in zip(texts, want)]


def test_tokenize_then_complete_and_continue_a_message(frontend: str, sdk: openai.OpenAI):
    """vLLM's /tokenize renders a chat as /v1/chat/completions does, so the ids it gives,
    sent back as a token-id prompt, answer as the chat does; continue_final_message carries
    on a prefilled answer exactly where the same text as a completion prompt would;
    /detokenize gives the text back."""
    messages = [{"role": "user", "content": "Name a color."}]
    status, tokens = post(frontend, "/tokenize", {"model": "ensemble", "messages": messages})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 10
    assert tokens["max_model_len"] == 2048
    extra = greedy(min_tokens=0)
    chat = sdk.chat.completions.create(model="ensemble", messages=messages,
                                       max_tokens=MAX_TOKENS, extra_body=extra)
    raw = sdk.completions.create(model="ensemble", prompt=tokens["tokens"],
                                 max_tokens=MAX_TOKENS, stop=["<|im_end|>"], extra_body=extra)
    assert raw.choices[0].text == chat.choices[0].message.content
    status, text = post(frontend, "/detokenize", {"model": "ensemble",
                                                  "tokens": tokens["tokens"]})
    assert status == 200 and text["prompt"].endswith("<|im_start|>assistant\n")
    prefilled = messages + [{"role": "assistant", "content": "The color"}]
    go_on = sdk.chat.completions.create(model="ensemble", messages=prefilled,
                                        max_tokens=MAX_TOKENS, extra_body={
                                            **extra, "continue_final_message": True,
                                            "add_generation_prompt": False})
    same = sdk.completions.create(model="ensemble", prompt=text["prompt"] + "The color",
                                  max_tokens=MAX_TOKENS, stop=["<|im_end|>"],
                                  extra_body=extra)
    assert go_on.choices[0].message.content == same.choices[0].text
    status, error = post(frontend, "/detokenize", {"model": "ensemble", "tokens": [999]})
    assert status == 400 and "outside the vocabulary" in error["error"]["message"]


def test_return_token_ids_gives_the_prompts_and_the_choices_ids(frontend: str,
                                                                 sdk: openai.OpenAI):
    """vLLM's return_token_ids: a completion's choices carry their prompt's ids (as /tokenize
    gives them, or the ids sent) and the ids they generated (whose text is theirs, one a
    completion token); a chat answer carries its prompt's ids; streamed, each chunk carries
    its ids and the first the prompt's, joining to the same."""
    extra = greedy(return_token_ids=True, min_tokens=0)
    prompt = "Name three colors:"
    reply = sdk.completions.create(model="ensemble", prompt=prompt, max_tokens=MAX_TOKENS, n=2,
                                   temperature=1.0, seed=5, extra_body=extra)
    status, tokens = post(frontend, "/tokenize", {"model": "ensemble", "prompt": prompt})
    assert status == 200
    for choice in reply.choices:
        extras = choice.model_extra
        assert extras["prompt_token_ids"] == tokens["tokens"]
        ids = extras["token_ids"]
        status, text = post(frontend, "/detokenize", {"model": "ensemble", "tokens": ids})
        assert status == 200 and text["prompt"] == choice.text
    assert sum(len(c.model_extra["token_ids"]) for c in reply.choices) == \
        reply.usage.completion_tokens
    plain = sdk.completions.create(model="ensemble", prompt=prompt, max_tokens=MAX_TOKENS, n=2,
                                   temperature=1.0, seed=5, extra_body={
                                       **extra, "return_token_ids": False})
    assert [c.text for c in plain.choices] == [c.text for c in reply.choices]
    assert all("token_ids" not in c.model_extra for c in plain.choices)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompts = []
    for chunk in sdk.completions.create(model="ensemble", prompt=prompt, max_tokens=MAX_TOKENS,
                                        n=2, temperature=1.0, seed=5, stream=True,
                                        extra_body=extra):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra.get("token_ids", [])
            prompts.append((c.index, c.model_extra.get("prompt_token_ids")))
    assert [streamed[0], streamed[1]] == [c.model_extra["token_ids"] for c in reply.choices]
    assert [i for i, p in prompts if p is not None] == [0, 1]  # each choice's first chunk
    assert all(p in (None, tokens["tokens"]) for _, p in prompts)
    by_ids = sdk.completions.create(model="ensemble", prompt=tokens["tokens"],
                                    max_tokens=4, extra_body=extra)
    assert by_ids.choices[0].model_extra["prompt_token_ids"] == tokens["tokens"]
    messages = [{"role": "user", "content": "Name a color."}]
    chat = sdk.chat.completions.create(model="ensemble", messages=messages,
                                       max_tokens=MAX_TOKENS, extra_body=extra)
    status, chat_tokens = post(frontend, "/tokenize", {"model": "ensemble",
                                                       "messages": messages})
    assert chat.model_extra["prompt_token_ids"] == chat_tokens["tokens"]
    ids = chat.choices[0].model_extra["token_ids"]
    status, text = post(frontend, "/detokenize", {"model": "ensemble", "tokens": ids})
    assert text["prompt"].startswith(chat.choices[0].message.content) and ids
    chunks = list(sdk.chat.completions.create(model="ensemble", messages=messages,
                                              max_tokens=MAX_TOKENS, stream=True,
                                              extra_body=extra))
    assert chunks[0].model_extra["prompt_token_ids"] == chat_tokens["tokens"]
    assert [t for c in chunks for ch in c.choices
            for t in ch.model_extra.get("token_ids", [])] == ids


def test_truncate_prompt_tokens_answers_the_prompts_end(frontend: str, sdk: openai.OpenAI):
    """vLLM's truncate_prompt_tokens: only the prompt's last N ids are answered (as the same
    completion of those ids), usage counts N; -1 keeps a prompt shorter than the context."""
    prompt = long_prompt("truncate", 400)
    status, tokens = post(frontend, "/tokenize", {"model": "ensemble", "prompt": prompt})
    assert status == 200 and tokens["count"] > 100
    extra = greedy(min_tokens=0, return_token_ids=True)
    cut = sdk.completions.create(model="ensemble", prompt=prompt, max_tokens=MAX_TOKENS,
                                 extra_body={**extra, "truncate_prompt_tokens": 64})
    assert cut.usage.prompt_tokens == 64
    assert cut.choices[0].model_extra["prompt_token_ids"] == tokens["tokens"][-64:]
    end = sdk.completions.create(model="ensemble", prompt=tokens["tokens"][-64:],
                                 max_tokens=MAX_TOKENS, extra_body=extra)
    assert cut.choices[0].text == end.choices[0].text
    whole = sdk.completions.create(model="ensemble", prompt=prompt, max_tokens=MAX_TOKENS,
                                   extra_body={**extra, "truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == tokens["count"]
    chat = sdk.chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": prompt}], max_tokens=4,
        extra_body={**extra, "truncate_prompt_tokens": 32})
    assert chat.usage.prompt_tokens == 32 and len(chat.model_extra["prompt_token_ids"]) == 32


def test_several_prompts_and_choices(sdk: openai.OpenAI):
    extra = greedy(cache_salt=uuid.uuid4().hex)
    reply = sdk.completions.create(model="ensemble", prompt=["First prompt", "Second prompt"],
                                   n=2, max_tokens=MAX_TOKENS, extra_body=extra)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.text for c in reply.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the same per prompt
    singles = [sdk.completions.create(model="ensemble", prompt=p, max_tokens=MAX_TOKENS,
                                      extra_body=extra).choices[0].text
               for p in ("First prompt", "Second prompt")]
    assert texts[0] == singles[0] and texts[2] == singles[1]
    assert reply.usage.completion_tokens == 4 * MAX_TOKENS
    assert reply.usage.prompt_tokens == len("First prompt") + len("Second prompt")
    streamed: dict[int, str] = {}
    for event in sdk.completions.create(model="ensemble", prompt=["First prompt",
                                        "Second prompt"], n=2, max_tokens=MAX_TOKENS,
                                        stream=True, extra_body=extra):
        for c in event.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == texts


def test_usage_reports_the_prompts_cached_tokens(sdk: openai.OpenAI):
    salt = uuid.uuid4().hex
    messages = [{"role": "user", "content": long_prompt("A long question to cache", 300)}]
    usages = [sdk.chat.completions.create(model="ensemble", messages=messages, max_tokens=4,
                                          extra_body={"cache_salt": salt, "top_k": 1}).usage
              for _ in range(2)]
    assert usages[0].prompt_tokens_details.cached_tokens == 0  # its own salt: cold
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached >= 256 and cached <= usages[1].prompt_tokens  # the whole pages of the prompt


def test_response_format_json_schema_gives_json(sdk: openai.OpenAI):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    reply = sdk.chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": "Your name as JSON"}],
        max_tokens=64, response_format={"type": "json_schema",
                                        "json_schema": {"name": "who", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"name"} and isinstance(value["name"], str)
    assert reply.choices[0].finish_reason == "stop"


BAD = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    # valid JSON, but no text: a lone surrogate (was a 500 from the tokenizer or encoder)
    ("/v1/completions", b'{"model": "ensemble", "prompt": "a\\ud800"}', 400, "lone UTF-16"),
    ("/v1/chat/completions", b'{"model": "ensemble", "messages": [{"role": "user", '
     b'"content": "\\udfff"}]}', 400, "lone UTF-16"),
    ("/tokenize", b'{"model": "ensemble", "prompt": "\\ud800"}', 400, "lone UTF-16"),
    ("/v1/completions", b'{"model": "ensemble", "prompt": "x", "stop": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", 400, "nests JSON too deeply"),  # was a 500 (RecursionError)
    ("/v1/completions", {"model": "ensemble", "prompt": "x", "n": 0}, 400, "'n' must be from 1"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "'nope' does not exist"),
    ("/v1/chat/completions", {"model": "ensemble", "messages": [{"role": "user"}]}, 400,
     "messages[0].content must be a string"),
    # found by the server (INVALID_ARG inside the gRPC stream), still a 400 with its reason
    ("/v1/completions", {"model": "ensemble", "prompt": "x" * 2100, "max_tokens": 4}, 400,
     "more than the context limit of 2048"),
    ("/v1/completions", {"model": "ensemble", "prompt": "x", "guided_regex": "(["}, 400,
     "not a valid regex"),
    # the chat default max_tokens is what the context leaves: here nothing
    ("/v1/chat/completions", {"model": "ensemble", "messages": [
        {"role": "user", "content": "y" * 2100}]}, 400, "leaves none of the context limit"),
    ("/v1/embeddings", {"model": "ensemble", "input": "x"}, 404, "Not Found"),
    ("/v1/completions", {"model": "ensemble", "prompt": [72, 999]}, 400,
     "token id 999 is outside the vocabulary"),
    ("/v1/completions", {"model": "ensemble", "prompt": "x", "logit_bias": {"260": 1}}, 400,
     "'logit_bias' token id 260 is outside the vocabulary"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, status, message", BAD)
def test_bad_requests_get_openai_errors(frontend: str, llm_server: ServerHandle, path, body,
                                        status, message):
    got, reply = post(frontend, path, body)
    assert got == status and message in reply["error"]["message"], reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    stream = dict(body, stream=True) if isinstance(body, dict) else body
    got, reply = post(frontend, path, stream)  # streamed: the same error, before any event
    assert got == status and message in reply["error"]["message"], reply
    idle_pool(llm_server)


def test_a_client_that_goes_away_cancels_its_request(frontend: str, llm_server: ServerHandle):
    def cancelled() -> float:
        return value(scrape(llm_server), "suffixreplay_unfinished_requests_total",
                     reason="cancelled")

    before = idle_pool(llm_server)
    cancelled_before = cancelled()
    body = {"model": "ensemble", "prompt": long_prompt("Hang up on the frontend", 150),
            "max_tokens": 1800, "min_tokens": 1800, "stream": True, "seed": 9}
    request = urllib.request.Request(f"{frontend}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
            if len(events) == 3:
                break
        wait_until(lambda: pool_state(llm_server)["held_by_requests"] > 0, 10, "held pages")
    # the connection is closed: the frontend cancels the gRPC stream, Triton the request
    after = idle_pool(llm_server, timeout_s=30)
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    # cancelled, not run to its end (1800 tokens)
    wait_until(lambda: cancelled() == cancelled_before + 1, 10, "the cancelled-requests metric")
    assert after["held_by_requests"] == 0
    assert after["free_or_cached"] == before["free_or_cached"]


def test_concurrent_clients_get_their_own_answers(sdk: openai.OpenAI):
    """Each client asks for its own number of tokens: a response routed to the wrong client
    would show in its usage (texts are not compared: a batch may break a near-tie otherwise)."""
    salt = uuid.uuid4().hex
    asks = [(f"Concurrent request number {i}:", 4 + 3 * i) for i in range(4)]

    def ask(prompt_and_tokens: tuple[str, int]) -> tuple[str, int, int]:
        prompt, tokens = prompt_and_tokens
        events = list(sdk.completions.create(
            model="ensemble", prompt=prompt, max_tokens=tokens, stream=True,
            stream_options={"include_usage": True},
            extra_body=greedy(cache_salt=salt, min_tokens=tokens)))
        text = "".join(e.choices[0].text for e in events if e.choices)
        return text, events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens

    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(ask, asks))
    for (prompt, tokens), (text, prompt_tokens, completion_tokens) in zip(asks, answers):
        assert (prompt_tokens, completion_tokens) == (len(prompt), tokens)
        assert text


def test_the_next_turn_of_a_chat_hits_the_last_ones_pages(sdk: openai.OpenAI):
    """The template re-renders the history each turn; the previous prompt and answer are a
    prefix of the next prompt, so their whole pages come from the cache (the answer's too:
    here 244 + 40 tokens, 256 cached, against the first prompt's 192 alone)."""
    extra = {"cache_salt": uuid.uuid4().hex, "top_k": 1, "session_id": uuid.uuid4().hex}
    messages = [{"role": "system", "content": long_prompt("You answer questions", 200)},
                {"role": "user", "content": "First question?"}]
    first = sdk.chat.completions.create(model="ensemble", messages=messages, max_tokens=40,
                                        extra_body=extra)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Second question?"}]
    second = sdk.chat.completions.create(model="ensemble", messages=messages, max_tokens=4,
                                         extra_body=extra)
    computed = first.usage.prompt_tokens + first.usage.completion_tokens  # what turn 1 cached
    assert second.usage.prompt_tokens > computed
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (computed - 1) // 64 * 64 > first.usage.prompt_tokens // 64 * 64


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time now",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}


def _streamed_calls(events) -> tuple[dict[int, dict], list[str | None], str]:
    """Tool-call deltas joined per index (id, name, arguments), finish reasons, content."""
    calls: dict[int, dict] = {}
    reasons, content = [], ""
    for event in events:
        for choice in event.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return calls, reasons, content


def test_a_named_tool_choice_returns_a_call_of_that_function(sdk: openai.OpenAI):
    """Guided by the function's schema: the answer is a call whose arguments are JSON of that
    schema, streamed or not (the streamed arguments join to the same text), content null."""
    ask = dict(model="ensemble", messages=[{"role": "user", "content": "Weather in Paris?"}],
               tools=[WEATHER, CLOCK], max_tokens=64,
               tool_choice={"type": "function", "function": {"name": "get_weather"}},
               extra_body={"top_k": 1, "cache_salt": uuid.uuid4().hex})
    reply = sdk.chat.completions.create(**ask)
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert choice.message.content is None and choice.finish_reason == "stop"
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 12
    calls, reasons, content = _streamed_calls(sdk.chat.completions.create(**ask, stream=True))
    assert content == "" and reasons[-1] == "stop"
    assert calls == {0: {"id": calls[0]["id"], "name": "get_weather",
                         "arguments": call.function.arguments}}


def test_required_tools_make_a_call_and_its_result_feeds_the_next_turn(sdk: openai.OpenAI,
                                                                        frontend: str):
    """tool_choice "required" with parallel_tool_calls false: exactly one call of one of the
    tools, finish_reason "tool_calls"; the call and the tool's result go back as the SDK
    returns them, and the next turn is served from the first turn's cached pages (the tools'
    system turn is a shared prefix, as in an agent's loop)."""
    salt = uuid.uuid4().hex
    messages = [{"role": "user", "content": "What time is it?"}]
    first = sdk.chat.completions.create(
        model="ensemble", messages=messages, tools=[WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, extra_body={"top_k": 1, "cache_salt": salt})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    streamed, reasons, _ = _streamed_calls(sdk.chat.completions.create(
        model="ensemble", messages=messages, tools=[WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, stream=True,
        extra_body={"top_k": 1, "cache_salt": salt}))
    assert reasons[-1] == "tool_calls" and [c["name"] for c in streamed.values()] == [
        call.function.name] and streamed[0]["arguments"] == call.function.arguments
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    second = sdk.chat.completions.create(
        model="ensemble", messages=messages, tools=[WEATHER, CLOCK], tool_choice="none",
        max_tokens=8, extra_body={"top_k": 1, "cache_salt": salt})
    assert second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    status, rendered = post(frontend, "/tokenize", {
        "model": "ensemble", "messages": messages, "tools": [WEATHER, CLOCK],
        "add_generation_prompt": True})
    assert status == 200 and rendered["count"] == second.usage.prompt_tokens
    text = post(frontend, "/detokenize", {"model": "ensemble",
                                           "tokens": rendered["tokens"]})[1]["prompt"]
    assert f'"name": "{call.function.name}"' in text and "<tool_response>\n12:00\n" in text
    assert second.usage.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens // 64 * 64 >= 64


def test_auto_tool_choice_answers_with_text_or_calls(sdk: openai.OpenAI):
    """"auto": whatever the tiny model writes comes back as content, or as calls of the
    known tools with finish_reason "tool_calls"; streamed the same."""
    ask = dict(model="ensemble", messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=[WEATHER, CLOCK], max_tokens=24,
               extra_body={"top_k": 1, "cache_salt": uuid.uuid4().hex})
    choice = sdk.chat.completions.create(**ask).choices[0]
    calls, reasons, content = _streamed_calls(sdk.chat.completions.create(**ask, stream=True))
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and reasons[-1] == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == [
            c["name"] for c in calls.values()]
    else:
        assert choice.finish_reason in ("stop", "length") and calls == {}
        assert choice.message.content == content


@pytest.mark.parametrize("call", [
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # Hermes JSON (Qwen3)
    "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>",  # Qwen3.5
])
def test_auto_reads_the_calls_the_model_writes(sdk: openai.OpenAI, call: str):
    """The tiny model was never taught to call tools, so a regex guide makes it write text
    then a call in one of Qwen's layouts: "auto" returns the text as content and the call as
    a tool call (finish_reason "tool_calls"), streamed the same (the tag's start held back)."""
    written = f"Checking.\n<tool_call>\n{call}\n</tool_call>"
    regex = "".join("\\" + c if c in '{}.[]()' else c for c in written)
    ask = dict(model="ensemble", messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=[WEATHER, CLOCK], max_tokens=len(written) + 8,
               extra_body={"top_k": 1, "cache_salt": uuid.uuid4().hex, "guided_regex": regex})
    choice = sdk.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    calls, reasons, content = _streamed_calls(sdk.chat.completions.create(**ask, stream=True))
    assert content == "Checking." and reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Oslo"})]
    # the same text with tool_choice "none" is all content
    none = sdk.chat.completions.create(**ask, tool_choice="none").choices[0]
    assert none.message.content == written and none.message.tool_calls is None
    assert none.finish_reason == "stop"


def test_auto_streams_a_calls_arguments_as_they_are_generated(sdk: openai.OpenAI):
    """The call's id and name go out before its arguments are written, the arguments in
    several deltas (one a generated token, where the guide leaves the model a choice) that
    join to the non-streamed answer's."""
    regex = ('<tool_call>\n\\{"name": "get_weather", "arguments": '
             '\\{"city": "[A-Z][a-z]{3,6}"\\}\\}\n</tool_call>')
    ask = dict(model="ensemble", messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=[WEATHER, CLOCK], max_tokens=96,
               extra_body={"top_k": 1, "cache_salt": uuid.uuid4().hex, "guided_regex": regex})
    [whole] = sdk.chat.completions.create(**ask).choices[0].message.tool_calls
    pieces = []  # (the event's position, the delta)
    events = list(sdk.chat.completions.create(**ask, stream=True))
    for i, event in enumerate(events):
        for choice in event.choices:
            pieces += [(i, d) for d in choice.delta.tool_calls or []]
    first, *rest = pieces
    assert (first[1].function.name, first[1].id) == ("get_weather", first[1].id) and first[1].id
    assert all(d.id is None and d.function.name is None and d.index == 0 for _, d in rest)
    assert len([d for _, d in pieces if d.function.arguments]) >= 3
    assert first[0] < pieces[-1][0] < len(events)
    joined = "".join(d.function.arguments or "" for _, d in pieces)
    assert joined == whole.function.arguments and json.loads(joined)["city"].isalpha()


def test_a_reasoning_parser_splits_the_thinking_from_the_answer(llm_server: ServerHandle,
                                                                tmp_path):
    """`--reasoning-parser qwen3`: a regex guide makes the tiny model think before its answer
    (and before a call); the <think> block comes back as reasoning_content, the rest as
    content or tool calls, streamed the same; a frontend without the parser returns it all
    as content (that one reads tool calls in Nemotron's layout: `--tool-call-parser
    nemotron`). The first also names logprobs' tokens by id (`--return-tokens-as-token-ids`)."""
    thought, answer = "I should look it up.", "It is sunny."
    written = f"<think>\n{thought}\n</think>\n\n{answer}"
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

    def regex(text: str) -> str:
        return "".join("\\" + c if c in '{}.[]()' else c for c in text)

    def ask(text: str, **extra) -> dict:
        return dict(model="ensemble", messages=[{"role": "user", "content": "Weather?"}],
                    max_tokens=len(text) + 8, **extra,
                    extra_body={"top_k": 1, "cache_salt": uuid.uuid4().hex,
                                "guided_regex": regex(text)})

    with running_frontend(llm_server, tmp_path / "thinking.log",
                          "--reasoning-parser", "qwen3", "--return-tokens-as-token-ids") as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        message = sdk.chat.completions.create(**ask(written)).choices[0].message
        assert (message.reasoning_content, message.content) == (f"\n{thought}\n", answer)
        # --return-tokens-as-token-ids: logprobs name tokens by id unless a request says not
        scored = sdk.chat.completions.create(**ask(written), logprobs=True).choices[0]
        names = [t.token for t in scored.logprobs.content]
        assert names and all(n.startswith("token_id:") for n in names)
        assert all(bytes(t.bytes) == t.token.encode() for t in scored.logprobs.content)
        request = ask(written, logprobs=True)
        request["extra_body"]["return_tokens_as_token_ids"] = False
        texts = sdk.chat.completions.create(**request).choices[0].logprobs.content
        assert "".join(t.token for t in texts).endswith(answer) and len(texts) == len(names)
        reasoning = content = ""
        for event in sdk.chat.completions.create(**ask(written), stream=True):
            for choice in event.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (f"\n{thought}\n", answer)
        # thinking, then a call: the call is read from what follows the reasoning
        choice = sdk.chat.completions.create(**ask(f"<think>{thought}</think>{call}",
                                                   tools=[CLOCK])).choices[0]
        assert choice.message.reasoning_content == thought
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        # a call straight out of the thinking (no </think>) ends it, with tools
        choice = sdk.chat.completions.create(**ask(f"<think>{thought}{call}",
                                                   tools=[CLOCK])).choices[0]
        assert choice.message.reasoning_content == thought and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        # an answer without a think block is all content
        plain = sdk.chat.completions.create(**ask(answer)).choices[0].message
        assert (plain.reasoning_content, plain.content) == (None, answer)
        # the Responses API: a reasoning item, then the message
        body = ask(written)
        response = sdk.responses.create(model="ensemble", input="Weather?",
                                        max_output_tokens=body["max_tokens"],
                                        extra_body=body["extra_body"])
        thinking, message = response.output
        assert thinking.type == "reasoning" and thinking.content[0].text == f"\n{thought}\n"
        assert response.output_text == answer and response.status == "completed"
        assert response.usage.output_tokens_details.reasoning_tokens == len(f"\n{thought}\n")
    # no reasoning parser; tool calls in Nemotron's layout
    with running_frontend(llm_server, tmp_path / "plain.log",
                          "--tool-call-parser", "nemotron") as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        message = sdk.chat.completions.create(**ask(written)).choices[0].message
        assert message.content == written
        assert getattr(message, "reasoning_content", None) is None
        calls = '<TOOLCALL>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", ' \
                '"arguments": {"city": "Rome"}}]</TOOLCALL>'
        choice = sdk.chat.completions.create(**ask(calls, tools=[CLOCK, WEATHER])).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in choice.message.tool_calls] == [("get_time", {}),
                                                        ("get_weather", {"city": "Rome"})]
        # Qwen's layout is text there
        choice = sdk.chat.completions.create(**ask(call, tools=[CLOCK])).choices[0]
        assert choice.message.content == call and choice.message.tool_calls is None


def test_responses_equal_the_chat_streamed_or_not(sdk: openai.OpenAI):
    """POST /v1/responses is the chat path: the same greedy text and prompt as a chat
    completion with the instructions as its system message; streamed, the text deltas join
    to the final response's text, events numbered in order, the item added before its text."""
    salt = uuid.uuid4().hex
    ask = dict(model="ensemble", instructions="Answer briefly.", input=PROMPT,
               max_output_tokens=MAX_TOKENS, extra_body={**greedy(cache_salt=salt)})
    response = sdk.responses.create(**ask)
    chat = sdk.chat.completions.create(
        model="ensemble", max_tokens=MAX_TOKENS, extra_body=greedy(cache_salt=salt),
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": PROMPT}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == MAX_TOKENS
    assert response.status == "incomplete"  # min_tokens = max_output_tokens: cut by length
    assert response.incomplete_details.reason == "max_output_tokens"
    events = list(sdk.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == response.output_text


def test_responses_call_a_tool_and_continue_from_the_stored_response(sdk: openai.OpenAI,
                                                                     frontend: str):
    """A forced call as a function_call item; its output sent with previous_response_id
    continues the stored conversation, which the prefix cache serves; the stored response
    can be read back and deleted; an unknown id is a 404."""
    salt = uuid.uuid4().hex
    tools = [{"type": "function", **CLOCK["function"]}]
    first = sdk.responses.create(
        model="ensemble", input="What time is it?", tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=64,
        extra_body={"top_k": 1, "cache_salt": salt})
    [call] = first.output
    assert (first.status, call.type, call.name, call.arguments) == (
        "completed", "function_call", "get_time", "{}")
    second = sdk.responses.create(
        model="ensemble", previous_response_id=first.id, tools=tools, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
        extra_body={"top_k": 1, "cache_salt": salt})
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= \
        first.usage.input_tokens // 64 * 64 >= 64
    assert sdk.responses.retrieve(second.id).output_text == second.output_text
    sdk.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(second.id)
    status, body = post(frontend, "/v1/responses", {
        "model": "ensemble", "input": "x", "previous_response_id": second.id})
    assert status == 404 and "not found" in body["error"]["message"]
    status, body = post(frontend, "/v1/responses", {
        "model": "ensemble", "input": "x", "tools": [{"type": "web_search"}]})
    assert status == 400 and "only function tools" in body["error"]["message"]


def test_metrics_count_requests_tokens_and_time_the_answers(frontend: str, sdk: openai.OpenAI):
    """`GET /metrics`: each request by route and status, the answers' tokens as their usage
    says, and a time to first token, a time per output token and an end-to-end latency per
    generation; histograms cumulative up to +Inf = their count."""
    from client.metrics import scrape as scrape_url

    name = "suffixreplay_frontend_"
    before = scrape_url(frontend)

    def delta(metric: str, **labels: str) -> float:
        now = value(after, name + metric, **labels)
        try:
            return now - value(before, name + metric, **labels)
        except KeyError:  # the first of its kind
            return now

    done = sdk.completions.create(model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  extra_body=greedy())
    chunks = list(sdk.chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}, extra_body=greedy()))
    chat = chunks[-1].usage
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model="ensemble", prompt=PROMPT, max_tokens=-1)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{frontend}/v1/nothing-here")
    after = scrape_url(frontend)
    completions, chats = {"endpoint": "/v1/completions"}, {"endpoint": "/v1/chat/completions"}
    assert delta("requests_total", status="200", **completions) == 1
    assert delta("requests_total", status="400", **completions) == 1
    assert delta("requests_total", status="200", **chats) == 1
    assert delta("requests_total", endpoint="unmatched", status="404") == 1
    assert delta("generation_tokens_total", **completions) == done.usage.completion_tokens \
        == MAX_TOKENS
    assert delta("prompt_tokens_total", **completions) == done.usage.prompt_tokens
    assert delta("generation_tokens_total", **chats) == chat.completion_tokens
    assert delta("cached_prompt_tokens_total", **chats) == \
        chat.prompt_tokens_details.cached_tokens
    assert delta("time_to_first_token_seconds_count", **completions) == 1  # not the 400
    assert delta("time_per_output_token_seconds_count", **chats) == 1
    assert delta("e2e_request_latency_seconds_count", **completions) == 2
    assert value(after, name + "requests_running", **completions) == 0
    for family in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in after.items()
                         if n == f"{name}{family}_bucket" and ("endpoint", "/v1/completions")
                         in labels)
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert counts[-1] == value(after, f"{name}{family}_count", **completions)
    ttft = delta("time_to_first_token_seconds_sum", **completions)
    e2e = delta("e2e_request_latency_seconds_sum", **chats)
    assert 0 < ttft < 60 and 0 < e2e < 60


def test_a_client_request_id_names_the_response_and_the_triton_request(frontend: str):
    """X-Request-Id (or vLLM's `request_id` field) becomes the answer's id after its prefix and
    comes back as a header, streamed or not; a malformed one is a 400 naming it."""
    def post(body: dict, headers: dict) -> tuple[int, dict, str]:
        req = urllib.request.Request(f"{frontend}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, dict(resp.headers), resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read().decode()

    body = {"model": "ensemble", "prompt": PROMPT, "max_tokens": MAX_TOKENS, **greedy()}
    status, headers, text = post(body, {"X-Request-Id": "trace-42.a"})
    assert status == 200 and json.loads(text)["id"] == "cmpl-trace-42.a"
    assert headers["X-Request-Id"] == "trace-42.a"
    status, headers, text = post({**body, "stream": True, "request_id": "abc:1"}, {})
    ids = {json.loads(line[6:])["id"] for line in text.splitlines()
           if line.startswith("data: {")}
    assert status == 200 and ids == {"cmpl-abc:1"} and headers["X-Request-Id"] == "abc:1"
    status, headers, text = post(body, {})  # none given: a fresh one, echoed all the same
    assert headers["X-Request-Id"] == json.loads(text)["id"].removeprefix("cmpl-")
    for bad, where in (({"X-Request-Id": "a b"}, "X-Request-Id"),
                       ({"X-Request-Id": "x" * 129}, "X-Request-Id")):
        status, _, text = post(body, bad)
        assert status == 400 and json.loads(text)["error"]["param"] == where
    status, _, text = post({**body, "request_id": 7}, {})
    assert status == 400 and "'request_id' must be" in json.loads(text)["error"]["message"]
    # a final newline passed a "$"-anchored check and then broke the response's header
    status, _, text = post({**body, "request_id": "abc\n"}, {})
    assert status == 400 and "'request_id' must be" in json.loads(text)["error"]["message"]


def test_the_triton_request_is_sent_under_the_given_id():
    from backend.openai_api.upstream import Upstream

    upstream = Upstream("127.0.0.1:1")  # never connected: only the message is made
    assert upstream.request({"text_input": "x"}, "trace-42").id == "trace-42"
    assert len(upstream.request({"text_input": "x"}).id) == 32
