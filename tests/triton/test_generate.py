"""Generation through the served ensemble: gRPC streaming, HTTP generate / generate_stream,
equality with the in-process engine, concurrency and the prefix cache seen by clients."""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.triton.server import ServerHandle
from client.generate import (
    Chunk,
    GenerateError,
    GenerateParams,
    generate_http,
    stream_grpc,
    stream_http,
)
from tests.triton.conftest import DEFAULT_MODEL, LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import idle_pool, long_prompt

PROMPT = "The capital of France is"
MAX_TOKENS = 12


def greedy(prompt: str, **options) -> GenerateParams:
    # min_tokens = max_tokens: every request yields exactly MAX_TOKENS tokens, whatever the model.
    options.setdefault("cache_salt", uuid.uuid4().hex)  # cold: nothing shared with other tests
    return GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1, **options)


def joined(chunks: list[Chunk]) -> str:
    return "".join(c.text for c in chunks)


def test_grpc_streaming_sends_one_response_per_token(llm_server: ServerHandle):
    chunks = list(stream_grpc(llm_server.urls.grpc, greedy(PROMPT)))
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert sum(c.counts["num_output_tokens"] for c in chunks) == MAX_TOKENS
    assert len(chunks) == MAX_TOKENS
    assert chunks[0].counts["num_input_tokens"] == len(PROMPT.encode())
    # finish_reason: "" on every response but the last, which says max_tokens ended it
    assert [c.finish_reasons for c in chunks] == [[""]] * (MAX_TOKENS - 1) + [["length"]]


def test_streamed_text_equals_non_streamed_text(llm_server: ServerHandle):
    params = greedy(PROMPT, cache_salt="stream-vs-not")
    streamed = joined(list(stream_grpc(llm_server.urls.grpc, params)))
    [whole] = list(stream_grpc(llm_server.urls.grpc, params, stream=False))
    assert whole.final and whole.counts["num_output_tokens"] == MAX_TOKENS
    assert streamed == whole.text


def test_http_generate_and_generate_stream_match_grpc(llm_server: ServerHandle):
    params = greedy(PROMPT, cache_salt="http-vs-grpc")
    grpc_text = joined(list(stream_grpc(llm_server.urls.grpc, params)))
    single = generate_http(llm_server.urls.http, params)
    events = list(stream_http(llm_server.urls.http, params))
    assert single.text == grpc_text == joined(events)
    assert single.counts["num_output_tokens"] == MAX_TOKENS
    assert len(events) == MAX_TOKENS
    assert single.finish_reasons == events[-1].finish_reasons == ["length"]


def test_allowed_token_ids_bound_the_text(llm_server: ServerHandle):
    """vLLM's allowed_token_ids through the ensemble: sampled text of those characters only
    (byte tokens), the same greedy text over gRPC and HTTP."""
    allowed = tuple(ord(c) for c in "abc ")
    sampled = GenerateParams(PROMPT, max_tokens=20, min_tokens=20, temperature=1.5, seed=9,
                             allowed_token_ids=allowed, cache_salt=uuid.uuid4().hex)
    text = joined(list(stream_grpc(llm_server.urls.grpc, sampled)))
    assert len(text) == 20 and set(text) <= set("abc "), text
    params = greedy(PROMPT, allowed_token_ids=allowed)
    assert generate_http(llm_server.urls.http, params).text == \
        joined(list(stream_grpc(llm_server.urls.grpc, params)))


def test_exclude_input_in_output_false_returns_the_prompt(llm_server: ServerHandle):
    params = greedy(PROMPT, exclude_input_in_output=False)
    assert generate_http(llm_server.urls.http, params).text.startswith(PROMPT)


@pytest.fixture(scope="module")
def local_engine(llm_server: ServerHandle) -> Engine:
    """The served model with the served engine settings, in this process."""
    assert llm_server.model_repository is not None
    model_dir = Path(llm_server.model_repository) / DEFAULT_MODEL
    engine = Engine.from_model_dir(model_dir, EngineConfig.from_params(LLM_PARAMS["hybrid_llm"]))
    return engine


def test_greedy_output_equals_in_process_engine(llm_server: ServerHandle, local_engine: Engine):
    prompt = long_prompt("Once upon a time", 90)
    served = generate_http(llm_server.urls.http, greedy(prompt))
    ids = local_engine.tokenizer.encode(prompt)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1)
    out = local_engine.generate(ids, sampling)
    assert served.text == local_engine.tokenizer.decode(out.new_token_ids, skip_special_tokens=True)
    assert served.counts["num_input_tokens"] == len(ids)


def test_same_seed_same_text_different_seed_differs(llm_server: ServerHandle):
    def sampled(seed: int) -> str:
        params = GenerateParams(PROMPT, max_tokens=24, min_tokens=24, temperature=1.5, seed=seed)
        return generate_http(llm_server.urls.http, params).text

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2)


def test_min_p_reaches_the_sampler(llm_server: ServerHandle, local_engine: Engine):
    """A seeded hot request with min_p is the in-process engine's; min_p = 1 keeps only the
    likeliest token, so it samples the greedy text."""
    params = dict(max_tokens=24, min_tokens=24, temperature=1.5, seed=3)
    ids = local_engine.tokenizer.encode(PROMPT)

    def served(**extra) -> str:
        return generate_http(llm_server.urls.http, GenerateParams(PROMPT, **params,
                                                                  **extra)).text

    def local(**extra) -> str:
        out = local_engine.generate(ids, SamplingParams(**params, **extra))
        return local_engine.tokenizer.decode(out.new_token_ids, skip_special_tokens=True)

    assert served(min_p=0.2) == local(min_p=0.2) != served()
    assert served(min_p=1.0) == generate_http(llm_server.urls.http, GenerateParams(
        PROMPT, max_tokens=24, min_tokens=24, top_k=1)).text


def test_two_concurrent_clients(llm_server: ServerHandle):
    prompts = ["First client says hello", "Second client asks a question"]
    results: dict[int, list[Chunk]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = list(stream_grpc(llm_server.urls.grpc, greedy(prompts[i])))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for i, prompt in enumerate(prompts):
        assert sum(c.counts["num_output_tokens"] for c in results[i]) == MAX_TOKENS
        assert results[i][0].counts["num_input_tokens"] == len(prompt)


def test_repeated_prefix_is_served_from_cache(llm_server: ServerHandle):
    params = greedy(long_prompt("A repeated system prompt"), cache_salt="repeat")
    first = generate_http(llm_server.urls.http, params)
    second = generate_http(llm_server.urls.http, params)
    assert first.counts["cached_tokens"] == 0
    assert second.counts["cached_tokens"] >= 128  # two full 64-token pages of 200 tokens
    assert second.counts["recomputed_tokens"] == 200 - second.counts["cached_tokens"]
    assert second.text == first.text


def test_cache_salts_never_share_hits(llm_server: ServerHandle):
    prompt = long_prompt("Tenant data")
    url = llm_server.urls.http
    assert generate_http(url, greedy(prompt, cache_salt="tenant-a")).counts["cached_tokens"] == 0
    assert generate_http(url, greedy(prompt, cache_salt="tenant-b")).counts["cached_tokens"] == 0
    assert generate_http(url, greedy(prompt, cache_salt="tenant-a")).counts["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("policy", "expect_hit"), [("suffixreplay", True), ("checkpoint", False)], ids=str
)
def test_branch_at_a_non_checkpoint_page_boundary(triton_server, policy: str, expect_hit: bool):
    """A prompt that shares 2 pages (128 tokens; checkpoints every 256) with an earlier one."""
    params = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "cache_policy": policy}}
    server = triton_server(LLM_MODELS, params)
    trunk = long_prompt("Shared conversation trunk", 300)
    branch = trunk[:128] + long_prompt(" and then a different turn", 60)
    generate_http(server.urls.http, greedy(trunk, cache_salt="branch"))
    hit = generate_http(server.urls.http, greedy(branch, cache_salt="branch"))
    if expect_hit:
        assert hit.counts["cached_tokens"] == 128
        assert hit.counts["replayed_anchors"] > 0
    else:
        assert hit.counts["cached_tokens"] == 0
    assert hit.counts["recomputed_tokens"] == len(branch) - hit.counts["cached_tokens"]


def ascii_char_at_or_after(text: str, start: int) -> str | None:
    """A printable ASCII character (one byte token) of `text`, if any."""
    return next((c for c in text[start:] if c.isascii() and c.isprintable()), None)


def test_stop_word_ends_the_request(llm_server: ServerHandle):
    prompt = "Stop words end generation:"
    plain = GenerateParams(prompt, max_tokens=24, top_k=1, cache_salt="stop")
    text = generate_http(llm_server.urls.http, plain).text
    stop = ascii_char_at_or_after(text, 2)
    if stop is None:
        pytest.skip(f"no printable ASCII in the greedy output {text!r}")
    stopped = GenerateParams(prompt, max_tokens=24, top_k=1, cache_salt="stop", stop_words=(stop,))
    out = generate_http(llm_server.urls.http, stopped)
    assert out.text == text[: text.index(stop) + 1]  # the stop word is kept, as TensorRT-LLM
    assert out.counts["num_output_tokens"] < 24
    assert out.finish_reasons == ["stop"]


def test_bad_word_is_never_produced(llm_server: ServerHandle):
    prompt = "Bad words are masked:"
    text = generate_http(llm_server.urls.http, greedy(prompt, cache_salt="bad")).text
    bad = ascii_char_at_or_after(text, 0)
    if bad is None:
        pytest.skip(f"no printable ASCII in the greedy output {text!r}")
    out = generate_http(llm_server.urls.http, greedy(prompt, cache_salt="bad", bad_words=(bad,)))
    assert bad not in out.text


def test_penalties_and_log_probs_equal_the_in_process_engine(llm_server: ServerHandle,
                                                             local_engine: Engine):
    """The penalties change the text exactly as in the engine, and the log probabilities
    arrive with the tokens they score (gRPC stream, HTTP generate, HTTP stream alike)."""
    prompt = long_prompt("Once upon a time", 90)
    controls = dict(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)
    params = greedy(prompt, return_log_probs=True, **controls)
    chunks = list(stream_grpc(llm_server.urls.grpc, params))
    ids = local_engine.tokenizer.encode(prompt)
    out = local_engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                                    top_k=1, return_log_probs=True, **controls))
    plain = local_engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS,
                                                      min_tokens=MAX_TOKENS, top_k=1))
    assert out.new_token_ids != plain.new_token_ids  # the penalties changed the text
    text = local_engine.tokenizer.decode(out.new_token_ids, skip_special_tokens=True)
    assert joined(chunks) == text
    streamed = [lp for c in chunks for lp in c.log_probs]
    assert streamed == pytest.approx(out.log_probs, abs=1e-4)
    assert chunks[-1].cum_log_prob == pytest.approx(out.cum_log_prob, abs=1e-3)
    assert all(len(c.log_probs) == c.counts["num_output_tokens"] for c in chunks)
    whole = generate_http(llm_server.urls.http, params)
    assert whole.text == text and whole.log_probs == pytest.approx(out.log_probs, abs=1e-4)
    events = list(stream_http(llm_server.urls.http, params))
    assert [lp for e in events for lp in e.log_probs] == pytest.approx(out.log_probs, abs=1e-4)
    # Not asked for: none, and a zero sum.
    bare = generate_http(llm_server.urls.http, greedy(prompt))
    assert bare.log_probs == [] and bare.cum_log_prob == 0.0


def test_top_log_probs_equal_the_in_process_engine(llm_server: ServerHandle,
                                                  local_engine: Engine):
    """num_top_log_probs = N: each response carries the N likeliest tokens at the positions of
    the ids it carries, the engine's own (gRPC stream [K, T, N], HTTP generate flat)."""
    prompt = long_prompt("The likeliest next tokens", 70)
    params = GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            temperature=0.8, seed=5, num_top_log_probs=4,
                            cache_salt=uuid.uuid4().hex)
    ids = local_engine.tokenizer.encode(prompt)
    out = local_engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS,
                                                    min_tokens=MAX_TOKENS, temperature=0.8,
                                                    seed=5, top_log_probs=4))
    want_ids = [[t for t, _ in position] for position in out.top_log_probs]
    want_values = [[v for _, v in position] for position in out.top_log_probs]
    chunks = list(stream_grpc(llm_server.urls.grpc, params))
    with_ids = [c for c in chunks if c.top_log_prob_ids is not None and c.counts.get(
        "num_output_tokens")]
    got_ids = [row for c in with_ids for row in c.top_log_prob_ids[0].tolist()]
    got_values = [row for c in with_ids for row in c.top_log_probs[0].tolist()]
    assert got_ids == want_ids and len(got_ids) == MAX_TOKENS
    assert np.allclose(got_values, want_values, atol=1e-4)
    assert [lp for c in chunks for lp in c.log_probs] == pytest.approx(out.log_probs, abs=1e-4)
    whole = generate_http(llm_server.urls.http, params)
    assert whole.top_log_prob_ids.tolist() == [i for row in want_ids for i in row]
    assert np.allclose(whole.top_log_probs, np.ravel(want_values), atol=1e-4)
    # Not asked for: not sent.
    assert generate_http(llm_server.urls.http, greedy(prompt)).top_log_probs is None


def test_prompt_log_probs_equal_the_in_process_engine(llm_server: ServerHandle,
                                                     local_engine: Engine):
    """return_prompt_log_probs: the prompt's ids and each of its tokens' log probability after
    the first (and with num_top_log_probs its position's alternatives) come once, the
    engine's own, streamed (gRPC, with two sequences: from the first) or not (HTTP)."""
    prompt = long_prompt("Score every token of this prompt", 80)
    ids = local_engine.tokenizer.encode(prompt)
    out = local_engine.generate(ids, SamplingParams(max_tokens=2, top_k=1, top_log_probs=2),
                                return_prompt_log_probs=True)
    params = GenerateParams(prompt, max_tokens=2, top_k=1, num_top_log_probs=2,
                            return_prompt_log_probs=True, num_return_sequences=2,
                            cache_salt=uuid.uuid4().hex)
    chunks = list(stream_grpc(llm_server.urls.grpc, params))
    carrying = [c for c in chunks if c.prompt_log_probs is not None and
                c.prompt_log_probs.size]
    assert len(carrying) == 1
    [scored] = carrying
    assert scored.prompt_token_ids.tolist() == ids
    assert np.allclose(scored.prompt_log_probs, out.prompt_log_probs, atol=1e-4)
    assert scored.prompt_top_log_prob_ids.tolist() == [[t for t, _ in p]
                                                       for p in out.prompt_top_log_probs]
    assert scored.prompt_log_prob_ranks.tolist() == out.prompt_log_prob_ranks
    whole = generate_http(llm_server.urls.http, GenerateParams(
        prompt, max_tokens=2, top_k=1, return_prompt_log_probs=True,
        cache_salt=params.cache_salt))
    assert whole.prompt_token_ids.tolist() == ids
    assert np.allclose(whole.prompt_log_probs, out.prompt_log_probs, atol=1e-4)
    assert whole.prompt_top_log_probs.size == 0
    assert whole.prompt_log_prob_ranks.tolist() == out.prompt_log_prob_ranks
    assert whole.counts["cached_tokens"] == 0  # scored: computed whole, though cached


def test_draft_input_ids_draft_the_output(llm_server: ServerHandle):
    """TensorRT-LLM's draft_input_ids (our engine: the output predicted, drafted from along
    the way): the same text, streamed or not, with drafts verified and kept (perf metrics),
    on a server without speculative decoding; ids outside the vocabulary are INVALID_ARG."""
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    params = GenerateParams(prompt, max_tokens=40, top_k=1, return_perf_metrics=True,
                            cache_salt=uuid.uuid4().hex)
    plain = generate_http(llm_server.urls.http, params)
    assert plain.perf["total_draft_tokens"] == 0
    predicted = replace(params, extra={"draft_input_ids": list(plain.text.encode())})
    whole = generate_http(llm_server.urls.http, predicted)
    assert whole.text == plain.text
    assert whole.perf["total_accepted_draft_tokens"] > 0  # how many: the adaptive policy's
    streamed = list(stream_grpc(llm_server.urls.grpc, predicted))
    assert "".join(c.text for c in streamed) == plain.text
    assert streamed[-1].perf["total_accepted_draft_tokens"] > 0
    with pytest.raises(GenerateError, match="the prediction holds token ids"):
        generate_http(llm_server.urls.http, replace(params, extra={"draft_input_ids": [10**7]}))
    idle_pool(llm_server)


def test_allotted_time_ms_ends_a_request_with_what_it_generated(llm_server: ServerHandle):
    """TensorRT-LLM's allotted_time_ms: a request still generating when its time is up ends
    with finish_reason timed_out and the text it had (a plain run of that many tokens gives
    the same), streamed or not; counted by the timed_out metric; past a day is INVALID_ARG
    (the BLS model: tests/triton/test_bls.py)."""
    from tests.triton.llm_helpers import scrape, value

    def timed_out() -> float:
        return value(scrape(llm_server), "suffixreplay_unfinished_requests_total",
                     reason="timed_out")

    before = timed_out()
    params = GenerateParams(PROMPT, max_tokens=2000, min_tokens=2000, top_k=1,
                            allotted_time_ms=400, cache_salt=uuid.uuid4().hex)
    cut = generate_http(llm_server.urls.http, params)
    n = cut.counts["num_output_tokens"]
    assert cut.finish_reasons == ["timed_out"] and 0 < n < 2000
    plain = generate_http(llm_server.urls.http, replace(
        params, max_tokens=n, min_tokens=n, allotted_time_ms=None))
    assert plain.text == cut.text and plain.finish_reasons == ["length"]
    streamed = list(stream_grpc(llm_server.urls.grpc, params))
    assert streamed[-1].final and streamed[-1].finish_reasons == ["timed_out"]
    assert 0 < sum(c.counts["num_output_tokens"] for c in streamed) < 2000
    in_time = generate_http(llm_server.urls.http, replace(params, max_tokens=4, min_tokens=4,
                                                          allotted_time_ms=60_000))
    assert in_time.finish_reasons == ["length"]
    with pytest.raises(GenerateError, match="allotted_time_ms must be in"):
        generate_http(llm_server.urls.http, replace(params, allotted_time_ms=10**9))
    idle_pool(llm_server)
    assert timed_out() == before + 2


def test_no_repeat_ngram_size_is_the_engines(llm_server: ServerHandle):
    """TensorRT-LLM's no_repeat_ngram_size through the ensemble: the tokens the engine gives
    in process (its own tests hold them to transformers'), and no bigram comes again."""
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    engine = Engine.from_model_dir(Path(llm_server.model_repository) / DEFAULT_MODEL,
                                   EngineConfig())
    want = engine.generate(list(prompt.encode()), SamplingParams(
        max_tokens=MAX_TOKENS * 2, min_tokens=MAX_TOKENS * 2, top_k=1, no_repeat_ngram_size=2,
        end_id=engine.eos_token_id))
    params = GenerateParams(prompt, max_tokens=MAX_TOKENS * 2, min_tokens=MAX_TOKENS * 2,
                            top_k=1, no_repeat_ngram_size=2, cache_salt=uuid.uuid4().hex)
    text = joined(list(stream_grpc(llm_server.urls.grpc, params)))
    assert text.encode() == bytes(want.new_token_ids)
    tokens = list((prompt + text).encode())
    bigrams = [tuple(tokens[i:i + 2]) for i in range(len(tokens) - 1)]
    assert all(bigrams[j] not in bigrams[:j] for j in range(len(prompt) - 1, len(bigrams)))
    plain = generate_http(llm_server.urls.http, GenerateParams(
        prompt, max_tokens=MAX_TOKENS * 2, min_tokens=MAX_TOKENS * 2, top_k=1,
        cache_salt=uuid.uuid4().hex))  # nothing cached for other tests' prompts
    assert plain.text != text


def test_embedding_bias_words_steer_the_text(llm_server: ServerHandle):
    """TensorRT-LLM's embedding_bias_words / _weights and our embedding_bias_token_ids /
    _weights: preprocessing turns them into a bias over the vocabulary, which the engine adds
    to the logits."""
    params = greedy(PROMPT, extra={"embedding_bias_words": ["Z"],
                                   "embedding_bias_weights": [50.0]})
    assert generate_http(llm_server.urls.http, params).text == "Z" * MAX_TOKENS
    against = greedy(PROMPT, extra={"embedding_bias_words": [" "],
                                    "embedding_bias_weights": [-100.0]})
    assert " " not in joined(list(stream_grpc(llm_server.urls.grpc, against)))
    by_id = greedy(PROMPT, extra={"embedding_bias_token_ids": [ord("Q")],
                                  "embedding_bias_token_weights": [50.0]})  # byte id = byte
    assert generate_http(llm_server.urls.http, by_id).text == "Q" * MAX_TOKENS
    both = greedy(PROMPT, extra={"embedding_bias_token_ids": [ord("Q")],
                                 "embedding_bias_token_weights": [-60.0],
                                 "embedding_bias_words": ["Q"],
                                 "embedding_bias_weights": [100.0]})  # they add up: +40
    assert joined(list(stream_grpc(llm_server.urls.grpc, both))) == "Q" * MAX_TOKENS
