"""num_return_sequences: K sequences from one prompt through the served ensemble. Sequence 0
prefills the prompt; the others start when its first token is out, from the prefix cache
(its pages and the state it left at their end), and sample with seeds seed, seed + 1, ...
Each sequence must be what the in-process engine generates alone with its seed."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.triton.server import ServerHandle
from client.generate import GenerateError, GenerateParams, generate_http, stream_grpc
from tests.triton.conftest import DEFAULT_MODEL, LLM_PARAMS
from tests.triton.llm_helpers import idle_pool, long_prompt, pool_state, wait_until

MAX_TOKENS = 12
K = 3
SEED = 11


def sampled(prompt: str, **options) -> GenerateParams:
    options.setdefault("cache_salt", uuid.uuid4().hex)  # cold: the siblings' hits are theirs
    return GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                          temperature=0.9, seed=SEED, num_return_sequences=K, **options)


@pytest.fixture(scope="module")
def local_engine(llm_server: ServerHandle) -> Engine:
    model_dir = Path(llm_server.model_repository) / DEFAULT_MODEL
    return Engine.from_model_dir(model_dir, EngineConfig.from_params(LLM_PARAMS["hybrid_llm"]))


def alone(engine: Engine, prompt: str, seed: int, log_probs: bool = False):
    """What the engine generates for `prompt` with `seed`, on its own and cold."""
    ids = engine.tokenizer.encode(prompt)
    out = engine.generate(ids, SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.9, seed=seed,
        return_log_probs=log_probs), cache_salt=uuid.uuid4().hex)
    return engine.tokenizer.decode(out.new_token_ids, skip_special_tokens=True), out


def test_http_generate_returns_every_sequence(llm_server: ServerHandle, local_engine: Engine):
    prompt = long_prompt("Three endings to one story", 150)
    whole = generate_http(llm_server.urls.http, sampled(prompt))
    expected = [alone(local_engine, prompt, SEED + k)[0] for k in range(K)]
    assert whole.texts == expected
    assert len(set(expected)) == K  # different seeds, different texts
    assert whole.sequence_index == -1 and whole.counts["num_output_tokens"] == K * MAX_TOKENS
    # The siblings started from the cache: each found the prompt's two whole pages.
    assert whole.counts["cached_tokens"] >= (K - 1) * 128, whole.counts


def test_grpc_stream_tags_each_response_with_its_sequence(llm_server: ServerHandle,
                                                          local_engine: Engine):
    prompt = long_prompt("Streams of several sequences", 100)
    chunks = list(stream_grpc(llm_server.urls.grpc, sampled(prompt, return_log_probs=True)))
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    texts, log_probs = [""] * K, [[] for _ in range(K)]
    for c in chunks:
        assert 0 <= c.sequence_index < K and len(c.texts) == K
        texts[c.sequence_index] += c.texts[c.sequence_index]
        assert not any(t for k, t in enumerate(c.texts) if k != c.sequence_index)
        log_probs[c.sequence_index] += c.log_probs
    for k in range(K):
        text, out = alone(local_engine, prompt, SEED + k, log_probs=True)
        assert texts[k] == text, k
        assert log_probs[k] == pytest.approx(out.log_probs, abs=1e-3), k
    whole = generate_http(llm_server.urls.http, sampled(prompt))
    assert whole.texts == texts  # streamed and not streamed agree


def test_greedy_sequences_are_identical(llm_server: ServerHandle):
    params = GenerateParams(long_prompt("Greedy twins", 80), max_tokens=MAX_TOKENS,
                            min_tokens=MAX_TOKENS, top_k=1, num_return_sequences=2,
                            cache_salt=uuid.uuid4().hex)
    whole = generate_http(llm_server.urls.http, params)
    assert len(whole.texts) == 2 and whole.texts[0] == whole.texts[1] != ""


def test_cancelling_several_sequences_releases_every_page(llm_server: ServerHandle):
    before = idle_pool(llm_server)
    params = GenerateParams(long_prompt("Cancel all four of us", 150), max_tokens=1500,
                            min_tokens=1500, seed=5, num_return_sequences=4,
                            cache_salt=uuid.uuid4().hex)
    stream = stream_grpc(llm_server.urls.grpc, params)
    seen = {next(stream).sequence_index for _ in range(12)}
    wait_until(lambda: pool_state(llm_server)["active"] >= 2, 10, "the siblings running")
    stream.close()
    after = idle_pool(llm_server, timeout_s=30)
    assert len(seen) > 1  # the siblings were streaming before the cancel
    assert after["held_by_requests"] == 0
    assert after["free_or_cached"] == before["free_or_cached"]


@pytest.mark.parametrize("n", [0, 65])
def test_out_of_range_counts_are_invalid(llm_server: ServerHandle, n: int):
    with pytest.raises(GenerateError) as info:
        generate_http(llm_server.urls.http, GenerateParams("hi", max_tokens=4,
                                                           num_return_sequences=n))
    assert info.value.status == "HTTP 400"
    assert "num_return_sequences must be in [1, 64]" in info.value.message
