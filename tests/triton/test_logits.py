"""TensorRT-LLM's `return_context_logits` / `return_generation_logits` served through the
ensemble: `context_logits` [1, P, V] are the model's logits at every prompt position (the
request computes its whole prompt even when it is cached) and `generation_logits` [1, K, T, V]
the raw logits that chose each generated token, per sequence or beam; transformers' forward
over the same weights is the oracle. Streamed responses carry their own tokens' rows, the
prompt's rows once; requests that do not ask get neither."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.tokenizer import Tokenizer
from backend.triton.server import ServerHandle
from client.generate import GenerateParams, generate_http, stream_grpc
from tests.triton.llm_helpers import idle_pool

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
ATOL = 2e-3  # the engine's kernels against transformers', fp32


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text  # byte-level: the text gives back its ids
    return ids


def params(salt: str | None = None, **options) -> GenerateParams:
    return GenerateParams(PROMPT, max_tokens=12, top_k=1, cache_salt=salt or uuid.uuid4().hex,
                          extra={"end_id": -1}, **options)


def test_http_rows_are_transformers_logits(llm_server: ServerHandle, hf, tokenizer):
    prompt = ids_of(tokenizer, PROMPT)
    salt = uuid.uuid4().hex
    ask = params(salt, return_context_logits=True, return_generation_logits=True)
    generate_http(llm_server.urls.http, ask)  # the prompt is cached now
    out = generate_http(llm_server.urls.http, ask)
    assert out.counts["cached_tokens"] == 0  # computed whole for its logits
    ids = ids_of(tokenizer, out.text)
    want = hf_logits(hf, prompt + ids)
    V = want.shape[1]
    np.testing.assert_allclose(out.context_logits.reshape(len(prompt), V),
                               want[:len(prompt)], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out.generation_logits.reshape(len(ids), V),
                               want[len(prompt) - 1:-1], atol=ATOL, rtol=0)
    # Without them: not sent, and the prompt comes from the cache again.
    plain = generate_http(llm_server.urls.http, params(salt))
    assert plain.text == out.text and plain.counts["cached_tokens"] > 0
    assert plain.context_logits is None and plain.generation_logits is None
    idle_pool(llm_server)


def test_streamed_responses_carry_their_own_rows(llm_server: ServerHandle, hf, tokenizer):
    prompt = ids_of(tokenizer, PROMPT)
    ask = params(return_context_logits=True, return_generation_logits=True)
    chunks = [c for c in stream_grpc(llm_server.urls.grpc, ask) if c.text]
    ids = ids_of(tokenizer, "".join(c.text for c in chunks))
    want = hf_logits(hf, prompt + ids)
    assert chunks[0].context_logits.shape == (len(prompt), want.shape[1])
    np.testing.assert_allclose(chunks[0].context_logits, want[:len(prompt)], atol=ATOL, rtol=0)
    assert all(c.context_logits.size == 0 for c in chunks[1:])  # the prompt's rows once
    rows = []
    for c in chunks:
        assert c.generation_logits.shape[:2] == (1, c.counts["num_output_tokens"])
        rows.append(c.generation_logits[0])
    np.testing.assert_allclose(np.concatenate(rows), want[len(prompt) - 1:-1], atol=ATOL,
                               rtol=0)
    idle_pool(llm_server)


def test_sequences_and_beams_each_have_their_rows(llm_server: ServerHandle, hf, tokenizer):
    prompt = ids_of(tokenizer, PROMPT)
    for options in (dict(num_return_sequences=2, temperature=1.0, top_k=0, seed=4),
                    dict(beam_width=3, top_k=0)):
        ask = params(return_context_logits=True, return_generation_logits=True)
        fields = {**ask.__dict__, **options}
        chunk = next(stream_grpc(llm_server.urls.grpc, GenerateParams(**fields), stream=False))
        K = len(chunk.texts)
        assert K == options.get("num_return_sequences", options.get("beam_width"))
        assert chunk.context_logits.shape[0] == len(prompt)  # once, for the one prompt
        assert chunk.generation_logits.shape[0] == K
        for k, text in enumerate(chunk.texts):
            ids = ids_of(tokenizer, text)
            want = hf_logits(hf, prompt + ids)
            np.testing.assert_allclose(chunk.generation_logits[k, :len(ids)],
                                       want[len(prompt) - 1:-1], atol=ATOL, rtol=0)
            assert not chunk.generation_logits[k, len(ids):].any()  # padding
        np.testing.assert_allclose(chunk.context_logits, want[:len(prompt)], atol=ATOL, rtol=0)
    idle_pool(llm_server)
