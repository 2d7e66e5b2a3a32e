"""Generation logits (`Request.return_generation_logits`, TensorRT-LLM's
`return_generation_logits`): the model's raw logits that chose each generated token, one row
per output token. transformers is the oracle: its forward over the prompt and the tokens
before each one gives the same row; a cache hit, speculative drafts, sampling controls and
beam search do not change what a row is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repo/hybrid_llm/1/tiny_qwen3_5"
PROMPT = list(b"def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
              b"\ndef fact(n):\n")
ATOL = 2e-3  # fp32 engine vs transformers: different kernels (chunked scans, fused decode)


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_model_dir(MODEL_DIR, EngineConfig())


def hf_rows(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits after the prompt and after each generated token but the last:
    the rows that chose `generated`."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(generated)]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, top_k=1, end_id=-1),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5, end_id=-1,
                   repetition_penalty=1.3, logit_bias=((32, 2.0),)),
], ids=["greedy", "sampled-penalized"])
def test_rows_are_transformers_logits(hf, engine, params):
    out = engine.generate(PROMPT, params, return_generation_logits=True)
    rows = out.generation_logits
    assert rows.shape == (len(out.new_token_ids), hf.config.vocab_size) and rows.dtype == \
        torch.float32
    torch.testing.assert_close(rows, hf_rows(hf, PROMPT, out.new_token_ids), atol=ATOL, rtol=0)
    if params.greedy and not params.penalized:
        assert rows.argmax(-1).tolist() == out.new_token_ids
    # A cache hit (the prompt's pages, a replay) gives the same rows.
    again = engine.generate(PROMPT, params, return_generation_logits=True)
    assert again.cached_tokens > 0 and again.new_token_ids == out.new_token_ids
    torch.testing.assert_close(again.generation_logits, rows, atol=1e-4, rtol=0)
    assert engine.generate(PROMPT, params).generation_logits is None  # only when asked


def test_streamed_rows_follow_the_tokens(engine):
    outs = []
    engine.submit(Request("streamed-logits", PROMPT, SamplingParams(max_tokens=10, top_k=1),
                          on_output=outs.append, return_generation_logits=True))
    while engine.has_work:
        engine.step()
    engine.scheduler.after_outputs()
    for out in outs:
        assert out.generation_logits.shape[0] == len(out.new_token_ids)
    whole = engine.generate(PROMPT, SamplingParams(max_tokens=10, top_k=1),
                            return_generation_logits=True)
    torch.testing.assert_close(torch.cat([o.generation_logits for o in outs]),
                               whole.generation_logits, atol=1e-4, rtol=0)


def test_speculative_rows_equal_a_token_a_step(engine):
    spec = Engine.from_model_dir(MODEL_DIR, EngineConfig(
        speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
        speculative_adaptive=False))
    prompt = list(b"The cat sat on the mat. The cat sat on the mat. The cat sat on the")
    params = SamplingParams(max_tokens=40, top_k=1)
    want = engine.generate(prompt, params, return_generation_logits=True)
    got = spec.generate(prompt, params, return_generation_logits=True)
    assert spec.stats()["spec_accepted_tokens"] > 0  # several tokens a step
    assert got.new_token_ids == want.new_token_ids
    torch.testing.assert_close(got.generation_logits, want.generation_logits, atol=1e-3, rtol=0)


def test_each_beam_has_its_own_rows(hf, engine):
    params = SamplingParams(max_tokens=16, beam_width=3, end_id=10, return_log_probs=True)
    out = engine.generate(PROMPT, params, return_generation_logits=True)
    assert len(out.beams) == 3
    for beam in out.beams:
        assert beam.logits.shape[0] == len(beam.token_ids)
        torch.testing.assert_close(beam.logits, hf_rows(hf, PROMPT, beam.token_ids),
                                   atol=ATOL, rtol=0)
        raw = torch.log_softmax(beam.logits, -1)[range(len(beam.token_ids)), beam.token_ids]
        torch.testing.assert_close(raw.tolist(), beam.log_probs, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.generation_logits, out.beams[0].logits)


def test_guided_tokens_each_get_their_row(hf, engine):
    """Tokens a grammar forces are drawn one a step when logits are asked for (jump-forward
    would add them without computing their logits)."""
    from backend.engine.guided import Guide

    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, ' \
             '"required": ["name"]}'
    params = SamplingParams(max_tokens=30, top_k=1, guide=Guide("json_schema", schema))
    out = engine.generate(list(b"user = "), params, return_generation_logits=True)
    assert bytes(out.new_token_ids).startswith(b'{"name":')
    torch.testing.assert_close(out.generation_logits,
                               hf_rows(hf, list(b"user = "), out.new_token_ids), atol=ATOL,
                               rtol=0)
    plain = engine.generate(list(b"user = "), params)
    assert plain.new_token_ids == out.new_token_ids  # the same output either way
