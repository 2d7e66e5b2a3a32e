"""Batched requests (TensorRT-LLM's): B prompts in one Triton request, input tensors of B rows.
Each prompt runs as a request of its own; its responses name it in batch_index and must be
what the same prompt gets alone. The final flag goes with the last response; a bad row fails
the whole request with a message naming it, and leaves no page held."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from backend.triton.server import ServerHandle
from client.generate import (
    Chunk,
    GenerateError,
    GenerateParams,
    batch_inputs,
    grpc_inputs,
    grpc_results,
    stream_grpc,
    stream_grpc_batch,
    stream_http,
)
from tests.triton.llm_helpers import idle_pool, long_prompt, scrape, value

MAX_TOKENS = 10
# Of different lengths: preprocessing pads the shorter ones, input_lengths cuts them again.
PROMPTS = [long_prompt("Batched one", 90), long_prompt("Batched two", 150), "Batched three"]


def greedy(prompt: str, salt: str, **options) -> GenerateParams:
    return GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1,
                          cache_salt=salt, **options)


def by_prompt(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    grouped: dict[int, list[Chunk]] = defaultdict(list)
    for chunk in chunks:
        grouped[chunk.batch_index].append(chunk)
    return grouped


def alone(server: ServerHandle, params: GenerateParams) -> str:
    return "".join(c.text for c in stream_grpc(server.urls.grpc, params))


def test_streamed_batch_answers_each_prompt_as_alone(llm_server: ServerHandle):
    salt = uuid.uuid4().hex
    params = [greedy(p, salt) for p in PROMPTS]
    chunks = list(stream_grpc_batch(llm_server.urls.grpc, params))
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    grouped = by_prompt(chunks)
    assert sorted(grouped) == [0, 1, 2]
    expected = [alone(llm_server, replace_salt(p)) for p in params]
    assert len(set(expected)) > 1  # the prompts differ, so would a mixed-up batch_index
    for b, prompt_chunks in grouped.items():
        assert "".join(c.text for c in prompt_chunks) == expected[b], b
        assert sum(c.counts["num_output_tokens"] for c in prompt_chunks) == MAX_TOKENS
        assert prompt_chunks[0].counts["num_input_tokens"] == len(PROMPTS[b].encode())
        assert prompt_chunks[-1].finish_reasons == ["length"]
    idle_pool(llm_server)


def test_non_streamed_batch_sends_one_response_per_prompt(llm_server: ServerHandle):
    salt = uuid.uuid4().hex
    params = [greedy(p, salt, return_log_probs=True) for p in PROMPTS[:2]]
    chunks = list(stream_grpc_batch(llm_server.urls.grpc, params, stream=False))
    assert [c.final for c in chunks] == [False, True]
    assert sorted(c.batch_index for c in chunks) == [0, 1]
    for chunk in chunks:
        [whole] = list(stream_grpc(llm_server.urls.grpc, replace_salt(params[chunk.batch_index]),
                                   stream=False))
        assert chunk.text == whole.text
        assert chunk.counts["num_output_tokens"] == MAX_TOKENS
        assert chunk.log_probs == pytest.approx(whole.log_probs, abs=1e-4)


def test_one_prompt_gets_batch_index_zero(llm_server: ServerHandle):
    """The output is sent (Chunk.batch_index defaults to 0, so read the tensor itself)."""
    inputs = grpc_inputs(greedy(PROMPTS[2], uuid.uuid4().hex).fields(True))
    indexes = [result.as_numpy("batch_index").reshape(-1).tolist()
               for result in grpc_results(llm_server.urls.grpc, "ensemble", inputs, 120)
               if "output_ids" in {o.name for o in result.get_response().outputs}]
    assert indexes and all(i == [0] for i in indexes), indexes


@pytest.mark.parametrize(("row", "option", "bad", "message"), [
    (1, "beam_width", 100, "batch item 1: beam_width must be in [1, 64], got 100"),
    (2, "end_id", 999, "batch item 2: end_id=999 is outside the vocabulary"),
])
def test_a_bad_row_fails_the_request_and_names_it(llm_server: ServerHandle, row: int,
                                                  option: str, bad: int, message: str):
    salt = uuid.uuid4().hex
    params = [greedy(p, salt, extra={option: bad if b == row else good})
              for b, (p, good) in enumerate(zip(PROMPTS, [1, 1, 1] if option == "beam_width"
                                                else [-1, -1, -1]))]
    cancelled = value(scrape(llm_server), "suffixreplay_unfinished_requests_total",
                      reason="cancelled")
    with pytest.raises(GenerateError, match="INVALID_ARG|batch item") as info:
        list(stream_grpc_batch(llm_server.urls.grpc, params))
    assert message in str(info.value)
    # Refused before any row was queued: none ran (none was cancelled), no page held.
    time.sleep(0.5)  # the metrics lag
    idle_pool(llm_server)
    assert value(scrape(llm_server), "suffixreplay_unfinished_requests_total",
                 reason="cancelled") == cancelled


def test_closing_a_batched_stream_cancels_every_prompt(llm_server: ServerHandle):
    salt = uuid.uuid4().hex
    params = [GenerateParams(p, max_tokens=400, min_tokens=400, cache_salt=salt)
              for p in PROMPTS]
    seen = set()
    stream = stream_grpc_batch(llm_server.urls.grpc, params)
    for chunk in stream:
        seen.add(chunk.batch_index)
        if len(seen) == len(PROMPTS):
            break
    stream.close()
    idle_pool(llm_server, timeout_s=20)


def test_engine_model_takes_padded_rows(llm_server: ServerHandle):
    """hybrid_llm itself: input_ids [2, T] padded past input_lengths, per-row parameters."""
    rows = [[72, 101, 108, 108, 111, 32], [66, 121, 101]]
    ids = np.zeros((2, 6), np.int32)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
    inputs = {"input_ids": ids,
              "input_lengths": np.array([[6], [3]], np.int32),
              "request_output_len": np.array([[4], [6]], np.int32),
              "runtime_top_k": np.array([[1], [1]], np.int32),
              "end_id": np.array([[-1], [-1]], np.int32),
              "cache_salt": np.array([[uuid.uuid4().hex.encode()]] * 2, np.object_)}
    got: dict[int, list[int]] = defaultdict(list)
    for result in grpc_results(llm_server.urls.grpc, "hybrid_llm", grpc_inputs(inputs), 120):
        names = {o.name for o in result.get_response().outputs}
        if "output_ids" in names:
            b = int(result.as_numpy("batch_index").reshape(-1)[0])
            got[b].extend(result.as_numpy("output_ids").reshape(-1).tolist())
    assert [len(got[0]), len(got[1])] == [4, 6]
    for b, row in enumerate(rows):
        one = {name: value[b:b + 1] for name, value in inputs.items()}
        one["input_ids"] = one["input_ids"][:, :len(row)]
        alone_ids = [t for result in grpc_results(llm_server.urls.grpc, "hybrid_llm",
                                                  grpc_inputs(one), 120)
                     if "output_ids" in {o.name for o in result.get_response().outputs}
                     for t in result.as_numpy("output_ids").reshape(-1).tolist()]
        assert got[b] == alone_ids


def test_batch_inputs_need_one_shape_per_input():
    with pytest.raises(ValueError, match="set the same options"):
        batch_inputs([GenerateParams("a", seed=1), GenerateParams("b")], True)
    with pytest.raises(ValueError, match="stop_words differ in shape"):
        batch_inputs([GenerateParams("a", stop_words=("x",)),
                      GenerateParams("b", stop_words=("x", "y"))], True)
    arrays = batch_inputs([GenerateParams("a", max_tokens=3), GenerateParams("bc")], False)
    assert arrays["text_input"].shape == (2, 1) and arrays["max_tokens"].tolist() == [[3], [64]]
    # allowed_token_ids: rows padded with -1, a prompt without them gets -1 only (none)
    padded = batch_inputs([GenerateParams("a", allowed_token_ids=(5, 6)), GenerateParams("b"),
                           GenerateParams("c", allowed_token_ids=(7,))], True)
    assert padded["allowed_token_ids"].tolist() == [[5, 6], [-1, -1], [7, -1]]


def replace_salt(params: GenerateParams) -> GenerateParams:
    """The same request in a cold namespace of its own: what the prompt gets alone."""
    return replace(params, cache_salt=uuid.uuid4().hex)


def test_a_guide_or_adapter_the_engine_refuses_fails_the_batch_before_any_row_runs(
        llm_server: ServerHandle):
    """A guide that does not compile, or an adapter the server does not have, in row 2: the
    request fails naming the row, and rows 0 and 1 were never queued."""
    salt = uuid.uuid4().hex
    cases = [
        ([{"guide_type": "regex", "guide": g} for g in ["[a-z ]+", "[a-z ]+", "(unclosed"]],
         "batch item 2: guided_decoding_guide is not a valid regex"),
        ([{"lora_name": n} for n in ["", "", "no-such-adapter"]],
         "batch item 2: unknown LoRA adapter 'no-such-adapter'"),
    ]
    for options, message in cases:
        params = [GenerateParams(p, max_tokens=1800, min_tokens=1800, top_k=1,
                                 cache_salt=salt, **o) for p, o in zip(PROMPTS, options)]
        cancelled = value(scrape(llm_server), "suffixreplay_unfinished_requests_total",
                          reason="cancelled")
        with pytest.raises(GenerateError) as info:
            list(stream_grpc_batch(llm_server.urls.grpc, params))
        assert message in str(info.value)
        time.sleep(0.5)  # the metrics lag
        idle_pool(llm_server, timeout_s=5)
        assert value(scrape(llm_server), "suffixreplay_unfinished_requests_total",
                     reason="cancelled") == cancelled


def test_http_generate_stream_takes_a_batch(llm_server: ServerHandle):
    salt = uuid.uuid4().hex
    params = [greedy(p, salt) for p in PROMPTS[1:]]
    chunks = list(stream_http(llm_server.urls.http, params))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]  # (never set)
    grouped = by_prompt(chunks)
    assert sorted(grouped) == [0, 1]
    for b, prompt_chunks in grouped.items():
        assert "".join(c.text for c in prompt_chunks) == alone(llm_server,
                                                               replace_salt(params[b]))


def test_http_batches_refuse_list_inputs(llm_server: ServerHandle):
    """Triton's generate endpoints refuse a batch with a list input (stop words...): the
    client says so before sending (it was HTTP 400 'batch size does not match')."""
    params = [replace(greedy(p, "x"), stop_words=("zz",)) for p in PROMPTS[1:]]
    with pytest.raises(ValueError, match=r"cannot set \['stop_words'\].*stream_grpc_batch"):
        list(stream_http(llm_server.urls.http, params))


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_rows_take_their_own_parameters(llm_server: ServerHandle, stream: bool):
    """Row 0 samples two sequences (seeded), row 1 runs a beam search of width 2, row 2 is
    greedy: each row's responses are what its request gets alone."""
    salt = uuid.uuid4().hex
    params = [
        GenerateParams(PROMPTS[0], max_tokens=8, min_tokens=8, temperature=0.9, seed=5,
                       num_return_sequences=2, beam_width=1, top_k=0, cache_salt=salt),
        GenerateParams(PROMPTS[1], max_tokens=8, min_tokens=8, temperature=1.0, seed=0,
                       num_return_sequences=2, beam_width=2, top_k=0, cache_salt=salt),
        GenerateParams(PROMPTS[2], max_tokens=8, min_tokens=8, temperature=1.0, seed=0,
                       num_return_sequences=1, beam_width=1, top_k=1, cache_salt=salt),
    ]
    grouped = by_prompt(list(stream_grpc_batch(llm_server.urls.grpc, params, stream=stream)))
    for b, p in enumerate(params):
        expected = final_texts(stream_grpc(llm_server.urls.grpc, replace_salt(p),
                                           stream=stream), p.num_return_sequences)
        assert final_texts(grouped[b], p.num_return_sequences) == expected, b


def final_texts(chunks, num: int) -> list[str]:
    """Each sequence's text (a streamed response adds to the one it names; one with
    sequence_index -1 holds every row whole)."""
    texts = [""] * num
    for chunk in chunks:
        whole = chunk.sequence_index == -1
        for k, text in enumerate(chunk.texts):
            texts[k] = text if whole else texts[k] + text
    return texts


def test_rows_of_different_lengths_pad_with_minus_one(llm_server: ServerHandle):
    """allowed_token_ids of 2 and 4 ids and none in one batch: the client pads the rows with
    -1 (a row of -1 only: every token)."""
    sets = ["ab", "wxyz", ""]
    params = [GenerateParams(p, max_tokens=12, min_tokens=12, temperature=1.5, seed=2,
                             cache_salt=uuid.uuid4().hex,
                             allowed_token_ids=tuple(ord(c) for c in chars))
              for p, chars in zip(PROMPTS, sets)]
    grouped = by_prompt(list(stream_grpc_batch(llm_server.urls.grpc, params)))
    for b, chars in enumerate(sets[:2]):
        text = "".join(c.text for c in grouped[b])
        assert len(text) == 12 and set(text) <= set(chars), (b, text)
    free = "".join(c.text for c in grouped[2])
    assert len(free) == 12 and not set(free) <= set("abwxyz"), free
