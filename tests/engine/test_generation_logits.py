"""Generation and context logits (`Request.return_generation_logits` /
`return_context_logits`, TensorRT-LLM's): the model's raw logits that chose each generated
token, one row per output token, and its logits at every prompt position. transformers is the
oracle: its forward over the prompt and the tokens before each one gives the same rows; a
cache hit, speculative drafts, chunked prefill, sampling controls and beam search do not
change what a row is, and a request asking for context logits computes its whole prompt."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_MODEL_DIR, hf_rows

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request

MODEL_DIR = TINY_MODEL_DIR
PROMPT = list(b"def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
              b"\ndef fact(n):\n")
ATOL = 2e-3  # fp32 engine vs transformers: different kernels (chunked scans, fused decode)


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


def hf_prompt_rows(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def test_context_rows_are_transformers_logits_even_when_the_prompt_is_cached(hf, engine):
    prompt = PROMPT + list(b"    return 1 if n < 2 else n * fact(n - 1)\n\n")
    engine.generate(prompt, SamplingParams(max_tokens=4, top_k=1))  # cached now
    out = engine.generate(prompt, SamplingParams(max_tokens=4, top_k=1),
                          return_context_logits=True)
    assert out.cached_tokens == 0  # computed whole: the store holds no logits
    want = hf_prompt_rows(hf, prompt)
    torch.testing.assert_close(out.context_logits, want, atol=ATOL, rtol=0)
    assert out.new_token_ids[0] == int(want[-1].argmax())  # the last row chose the first token
    # Its pages joined the store: the next request of that prompt hits them.
    assert engine.generate(prompt, SamplingParams(max_tokens=2, top_k=1)).cached_tokens > 0


def test_context_rows_over_chunks_beside_drafts_and_beams(hf):
    """A prompt prefilled in several chunks beside decoding rows with drafts, and a beam
    search's prompt: each gets all of its rows, the others' outputs are unchanged."""
    spec = Engine.from_model_dir(MODEL_DIR, EngineConfig(
        speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
        speculative_adaptive=False, max_tokens_per_step=64))
    echo = list(b"The cat sat on the mat. The cat sat on the mat. The cat sat on the")
    long = PROMPT * 3
    beam = list(b"import os\nimport sys\n")
    greedy = SamplingParams(max_tokens=30, top_k=1)
    want_echo = spec.generate(echo, greedy).new_token_ids
    want_long = spec.generate(long, SamplingParams(max_tokens=3, top_k=1)).new_token_ids
    want_beams = [b.token_ids for b in spec.generate(
        beam, SamplingParams(max_tokens=6, beam_width=2)).beams]
    outs: dict[str, list] = {"echo": [], "long": [], "beam": []}
    spec.submit(Request("echo", echo, greedy, on_output=outs["echo"].append))
    for _ in range(3):  # the echo request is decoding (with drafts) when the others come
        spec.step()
    spec.submit(Request("long", long, SamplingParams(max_tokens=3, top_k=1),
                        on_output=outs["long"].append, return_context_logits=True))
    spec.submit(Request("beam", beam, SamplingParams(max_tokens=6, beam_width=2),
                        on_output=outs["beam"].append, return_context_logits=True))
    drafts0 = spec.stats()["spec_draft_tokens"]
    while spec.has_work:
        spec.step()
    spec.scheduler.after_outputs()
    assert spec.stats()["spec_draft_tokens"] > drafts0
    assert sum((o.new_token_ids for o in outs["echo"]), []) == want_echo
    for name, prompt in (("long", long), ("beam", beam)):
        first = outs[name][0]
        torch.testing.assert_close(first.context_logits, hf_prompt_rows(hf, prompt),
                                   atol=ATOL, rtol=0)
        assert all(o.context_logits is None for o in outs[name][1:])
    assert sum((o.new_token_ids for o in outs["long"]), []) == want_long
    assert [b.token_ids for b in outs["beam"][0].beams] == want_beams


@pytest.mark.parametrize("ask", ["return_context_logits", "return_prompt_log_probs"])
def test_prompt_logits_need_the_eager_executor(engine, ask):
    from dataclasses import replace

    compiled = Engine.__new__(Engine)
    compiled.__dict__.update(engine.__dict__)
    compiled.config = replace(engine.config, executor="compiled")
    with pytest.raises(ValueError, match=f"{ask} needs executor 'torch'"):
        compiled.submit(Request("ctx", PROMPT, SamplingParams(), **{ask: True}))


def test_prompt_log_probs_score_each_prompt_token_over_chunks(hf, monkeypatch):
    """return_prompt_log_probs: the log probability of each prompt token after the first under
    transformers' logits at the position before it (and, with top_log_probs, that position's
    likeliest tokens), from a prompt prefilled in several chunks beside another request,
    computed whole although its pages are cached; with context logits on the same request,
    both come; the scores come once, on the first output. Each chunk is scored 20 rows at a
    time (the scheduler's bound on the copies it makes, 256 rows by default)."""
    from backend.engine import scheduler

    monkeypatch.setattr(scheduler, "PROMPT_SCORE_ROWS", 20)
    chunked = Engine.from_model_dir(MODEL_DIR, EngineConfig(max_tokens_per_step=64))
    prompt = PROMPT * 3  # 3 chunks of at most 64 tokens
    chunked.generate(prompt, SamplingParams(max_tokens=2, top_k=1))  # its pages cached
    outs: dict[str, list] = {"scored": [], "other": []}
    chunked.submit(Request("other", PROMPT[::-1], SamplingParams(max_tokens=12, top_k=1),
                           on_output=outs["other"].append))
    chunked.submit(Request("scored", prompt, SamplingParams(max_tokens=5, top_k=1,
                                                            top_log_probs=3),
                           on_output=outs["scored"].append, return_prompt_log_probs=True,
                           return_context_logits=True))
    while chunked.has_work:
        chunked.step()
    chunked.scheduler.after_outputs()
    first = outs["scored"][0]
    assert first.cached_tokens == 0
    want = torch.log_softmax(hf_prompt_rows(hf, prompt), -1)
    targets = torch.tensor(prompt[1:])
    expected = want[torch.arange(len(prompt) - 1), targets]
    assert len(first.prompt_log_probs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(first.prompt_log_probs), expected, atol=ATOL,
                               rtol=0)
    top = want[:-1].topk(3)
    assert [[t for t, _ in p] for p in first.prompt_top_log_probs] == top.indices.tolist()
    # Each token's rank at its position: 1 + the tokens transformers finds likelier (with a
    # margin, so float noise between the two computations cannot move it).
    above = (want[:-1] > expected[:, None] + 1e-4).sum(-1) + 1
    at_most = (want[:-1] > expected[:, None] - 1e-4).sum(-1)
    ranks = torch.tensor(first.prompt_log_prob_ranks)
    assert len(ranks) == len(prompt) - 1 and (ranks >= above).all() and (ranks <= at_most).all()
    assert (ranks > 1).any() and (ranks == 1).any()
    for r, ids, token in zip(ranks.tolist(), top.indices.tolist(), prompt[1:]):
        assert (r <= 3) == (token in ids) and (r > 3 or ids[r - 1] == token)
    torch.testing.assert_close(torch.tensor([[v for _, v in p] for p in
                                             first.prompt_top_log_probs]), top.values,
                               atol=ATOL, rtol=0)
    assert first.context_logits.shape[0] == len(prompt)
    assert all(o.prompt_log_probs is None for o in outs["scored"][1:])
    # Not asked: none; a one-token prompt has nothing to score.
    assert chunked.generate(prompt, SamplingParams(max_tokens=2)).prompt_log_probs is None
    single = chunked.generate(prompt[:1], SamplingParams(max_tokens=2),
                              return_prompt_log_probs=True)
    assert single.prompt_log_probs == [] and single.prompt_log_prob_ranks == []
