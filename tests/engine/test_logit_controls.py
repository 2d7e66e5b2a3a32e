"""Penalties, logit bias and log probabilities through the engine, on the trained default
model, with transformers as the oracle: its `generate` for the repetition penalty (the same
rule as its RepetitionPenaltyLogitsProcessor), and its raw logits, changed by the documented
rules (`engine_helpers.reference_adjust`), for the rest."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_MODEL_DIR, assert_no_leak, hf_rows, reference_adjust

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request

MODEL_DIR = TINY_MODEL_DIR
PROMPT = list(b"def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
              b"\ndef fact(n):\n")
TOLERANCE = 1e-3


def assert_follows_rules(hf, prompt, tokens, log_probs, params: SamplingParams, what: str):
    """Each token is the argmax (within TOLERANCE) of transformers' logits changed by the
    documented rules for the tokens before it; each log probability is the raw log-softmax."""
    assert tokens, what
    rows = hf_rows(hf, prompt, tokens)
    for i, token in enumerate(tokens):
        adjusted = reference_adjust(rows[i], prompt, tokens[:i], params)
        gap = float(adjusted.max() - adjusted[token])
        assert gap <= TOLERANCE, f"{what}: token {i} trails the rules' choice by {gap:.4f}"
    if params.return_log_probs:
        expected = torch.log_softmax(rows, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-4, rtol=0,
                                   msg=lambda m: f"{what}: {m}")


def test_repetition_penalty_is_transformers_generate(hf, engine):
    params = SamplingParams(max_tokens=24, top_k=1, repetition_penalty=1.5, return_log_probs=True)
    out = engine.generate(PROMPT, params)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                      repetition_penalty=1.5, eos_token_id=None, pad_token_id=259,
                      output_logits=True, return_dict_in_generate=True)
    expected = ref.sequences[0, len(PROMPT):].tolist()
    assert out.new_token_ids == expected
    # The penalty changed the text (else this test would not see it).
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=24, top_k=1))
    assert plain.new_token_ids != expected
    raw = torch.stack([torch.log_softmax(step[0].float(), -1)[t]
                       for step, t in zip(ref.logits, expected)])
    torch.testing.assert_close(torch.tensor(out.log_probs), raw, atol=1e-4, rtol=0)
    assert out.cum_log_prob == pytest.approx(float(raw.sum()), abs=1e-3)
    assert_no_leak(engine)


CASES = {
    "presence": SamplingParams(max_tokens=20, top_k=1, presence_penalty=1.5),
    "frequency": SamplingParams(max_tokens=20, top_k=1, frequency_penalty=0.8),
    "all+bias": SamplingParams(max_tokens=20, top_k=1, repetition_penalty=1.2,
                               presence_penalty=0.3, frequency_penalty=0.4,
                               logit_bias=((ord("s"), -4.0), (ord("n"), 2.0)),
                               return_log_probs=True),
    "plain+log_probs": SamplingParams(max_tokens=20, top_k=1, return_log_probs=True),
    "allowed+bias": SamplingParams(max_tokens=20, top_k=1, return_log_probs=True,
                                   allowed_token_ids=tuple(b"abcdefnrstu ()\n"),
                                   logit_bias=((ord("u"), 1.5),)),
}


def test_mixed_batch_each_row_follows_its_own_rules(hf, engine):
    """Four requests decoded in the same steps, each with other controls."""
    outs: dict[str, list] = {name: [] for name in CASES}
    for name, params in CASES.items():
        engine.submit(Request(f"mixed-{name}", PROMPT, params, on_output=outs[name].append))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 500
    texts = set()
    for name, params in CASES.items():
        tokens = [t for o in outs[name] for t in o.new_token_ids]
        log_probs = [lp for o in outs[name] for lp in o.log_probs]
        assert len(tokens) == params.max_tokens, name
        assert len(log_probs) == (len(tokens) if params.return_log_probs else 0), name
        if params.return_log_probs:  # streamed: the running sum rides on each output
            assert outs[name][-1].cum_log_prob == pytest.approx(sum(log_probs), abs=1e-4)
        assert_follows_rules(hf, PROMPT, tokens, log_probs, params, name)
        texts.add(tuple(tokens))
    assert len(texts) == len(CASES)  # every control changed the text
    assert_no_leak(engine)


@pytest.fixture(scope="module")
def exact_engine():
    """Suffix replay that rebuilds states exactly (every token an anchor, all replayed), so a
    cache hit's logits are a cold prefill's and 1e-4 separates right from wrong."""
    return Engine.from_model_dir(MODEL_DIR, EngineConfig.from_params(
        {"anchor_density": "1.0", "budget_fraction": "1.0", "k_max": "none"}))


def test_penalties_see_the_whole_prompt_on_a_cache_hit(hf, exact_engine):
    """A second request that matches the first one's prompt from the prefix cache (and one
    that branches from it) still penalizes every prompt token: counts come from the tokens,
    not from what was computed."""
    engine = exact_engine
    params = SamplingParams(max_tokens=16, top_k=1, repetition_penalty=1.4, return_log_probs=True)
    long_prompt = PROMPT * 3  # several pages: the repeat is served from the cache
    cold = engine.generate(long_prompt, params, cache_salt="penalty-hit")
    warm = engine.generate(long_prompt, params, cache_salt="penalty-hit")
    assert warm.cached_tokens > 0
    assert warm.new_token_ids == cold.new_token_ids
    torch.testing.assert_close(torch.tensor(warm.log_probs), torch.tensor(cold.log_probs),
                               atol=1e-4, rtol=0)
    branch = long_prompt[:150] + list(b"    return n * fact(n - 1)\n")
    out = engine.generate(branch, params, cache_salt="penalty-hit")
    assert out.cached_tokens > 0
    assert_follows_rules(hf, branch, out.new_token_ids, out.log_probs, params, "branch")
    assert_no_leak(engine)


def test_top_log_probs_are_the_models_likeliest_tokens(hf, engine):
    """top_log_probs = N: at every generated position the N likeliest tokens of the model's
    raw distribution (transformers' logits), likeliest first, whatever sampled the token
    (here a seeded draw under penalties and a bias, so the chosen one is often not among
    them); the chosen token's log probability comes with them (top_log_probs implies it).
    A request beside it without them gets none."""
    params = SamplingParams(max_tokens=24, temperature=1.3, seed=11, repetition_penalty=1.3,
                            logit_bias=((ord("e"), 3.0),), top_log_probs=5)
    assert params.return_log_probs
    outs: dict[str, list] = {"top": [], "plain": []}
    engine.submit(Request("top-lp", PROMPT, params, on_output=outs["top"].append))
    engine.submit(Request("plain-lp", PROMPT, SamplingParams(max_tokens=24, top_k=1,
                                                             return_log_probs=True),
                          on_output=outs["plain"].append))
    while engine.has_work:
        engine.step()
    assert all(o.top_log_probs == [] for o in outs["plain"])
    tokens = [t for o in outs["top"] for t in o.new_token_ids]
    tops = [t for o in outs["top"] for t in o.top_log_probs]
    log_probs = [lp for o in outs["top"] for lp in o.log_probs]
    assert len(tops) == len(tokens) == len(log_probs) == 24
    rows = torch.log_softmax(hf_rows(hf, PROMPT, tokens), -1)
    outside = 0
    for i, (token, top) in enumerate(zip(tokens, tops)):
        ids = [t for t, _ in top]
        values = torch.tensor([v for _, v in top])
        assert len(ids) == 5 == len(set(ids)), i
        assert values.tolist() == sorted(values.tolist(), reverse=True), i
        torch.testing.assert_close(values, rows[i][ids], atol=1e-4, rtol=0)
        torch.testing.assert_close(values, rows[i].topk(5).values, atol=1e-4, rtol=0)
        assert log_probs[i] == pytest.approx(float(rows[i][token]), abs=1e-4)
        outside += token not in ids
    assert outside > 0  # the draw (bias, penalty, temperature) left the model's top 5
    assert_no_leak(engine)


def test_top_log_probs_are_checked(engine):
    with pytest.raises(ValueError, match="top_log_probs must be in"):
        SamplingParams(top_log_probs=21)
    with pytest.raises(ValueError, match="top_log_probs with beam search"):
        SamplingParams(beam_width=2, top_log_probs=1)
    from types import SimpleNamespace

    small = Engine.__new__(Engine)  # a vocabulary smaller than the alternatives asked for
    small.__dict__.update(engine.__dict__)
    small.model_config = SimpleNamespace(vocab_size=16)
    with pytest.raises(ValueError, match="top_log_probs=20 is more than the vocabulary's 16"):
        small.submit(Request("small", [1, 2], SamplingParams(top_log_probs=20)))


def test_seeded_sampling_with_penalties_repeats(engine):
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=7, frequency_penalty=0.5,
                            presence_penalty=0.2, repetition_penalty=1.1, return_log_probs=True)
    a, b = (engine.generate(PROMPT, params) for _ in range(2))
    assert a.new_token_ids == b.new_token_ids and a.log_probs == b.log_probs
    assert all(lp <= 0 for lp in a.log_probs) and len(a.log_probs) == len(a.new_token_ids)


def test_an_end_token_that_is_not_output_has_no_log_probability(engine):
    ref = engine.generate(PROMPT, SamplingParams(max_tokens=12, top_k=1, end_id=-1))
    end = ref.new_token_ids[5]
    out = engine.generate(PROMPT, SamplingParams(max_tokens=12, top_k=1, end_id=end,
                                                 return_log_probs=True))
    assert out.finish_reason == "eos"
    assert len(out.log_probs) == len(out.new_token_ids) == ref.new_token_ids.index(end)
    assert out.cum_log_prob == pytest.approx(sum(out.log_probs), abs=1e-5)


def test_logit_bias_ids_outside_the_vocabulary_are_rejected(engine):
    with pytest.raises(ValueError, match=r"logit_bias names token ids \[999\] outside"):
        engine.generate(PROMPT, SamplingParams(logit_bias=((999, 1.0),)))
    assert_no_leak(engine)


ALLOWED = tuple(b"0123456789 ")


def test_allowed_token_ids_bound_sampling_and_beams(engine):
    """vLLM's allowed_token_ids: sampled tokens and every beam stay in the set (greedy rows
    against transformers: CASES["allowed+bias"] above)."""
    sampled = engine.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.5, seed=3,
                                                     allowed_token_ids=ALLOWED))
    assert len(sampled.new_token_ids) == 30 and set(sampled.new_token_ids) <= set(ALLOWED)
    beams = engine.generate(PROMPT, SamplingParams(max_tokens=8, beam_width=3,
                                                   allowed_token_ids=ALLOWED))
    assert len(beams.beams) == 3
    for beam in beams.beams:
        assert beam.token_ids and set(beam.token_ids) <= set(ALLOWED)
    assert_no_leak(engine)


def test_allowed_token_ids_stand_where_min_tokens_would_leave_nothing(engine):
    """Only the end token allowed, before min_tokens: the allowed set stands (as a guide's
    choices do) rather than drawing from nothing; the end tokens drawn before min_tokens are
    output, as any end token that does not end a request, and the one at min_tokens ends it."""
    end = engine.eos_token_id
    out = engine.generate(PROMPT, SamplingParams(max_tokens=8, min_tokens=4, top_k=1,
                                                 allowed_token_ids=(end,)))
    assert out.new_token_ids == [end] * 3 and out.finish_reason == "eos"
    assert_no_leak(engine)


@pytest.mark.parametrize(("options", "message"), [
    ({"allowed_token_ids": (3, 999)}, r"allowed_token_ids holds token ids \[999\] outside"),
    ({"allowed_token_ids": (3, 3)}, "names a token id twice"),
])
def test_allowed_token_ids_are_checked(engine, options, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPT, SamplingParams(**options))
    assert_no_leak(engine)


# Accepted (finite) values that push logits past float32's range: 3e38 + 3e38 is inf.
EXTREME = {
    "bias": SamplingParams(max_tokens=6, temperature=0.5, seed=1,
                           logit_bias=((97, 3e38), (98, 3e38))),
    "bias-greedy": SamplingParams(max_tokens=6, top_k=1, logit_bias=((97, 3e38), (98, 3e38))),
    "frequency": SamplingParams(max_tokens=6, temperature=0.7, seed=2,
                                frequency_penalty=-3e38),
    "repetition": SamplingParams(max_tokens=6, temperature=0.7, seed=3,
                                 repetition_penalty=1e-38),
    "presence-bans-all": SamplingParams(max_tokens=6, temperature=0.7, seed=4,
                                        presence_penalty=3e38, logit_bias=((97, -3e38),)),
}


@pytest.mark.parametrize("name", EXTREME)
def test_extreme_biases_and_penalties_never_fail_the_batch(engine, name):
    """A request whose bias or penalties overflow its logits decodes beside a plain greedy
    one in the same steps: both run to max_tokens, the plain one's tokens are those it gets
    alone, and a +inf logit wins (the two 3e38-biased tokens are the only ones drawn). (Before,
    torch.multinomial raised on the row's inf / nan and the failed step ended both.)"""
    plain = SamplingParams(max_tokens=24, top_k=1)
    alone = engine.generate(PROMPT, plain).new_token_ids
    outs: dict[str, list] = {"plain": [], name: []}
    engine.submit(Request("extreme-plain", PROMPT, plain, on_output=outs["plain"].append))
    engine.submit(Request(f"extreme-{name}", PROMPT, EXTREME[name],
                          on_output=outs[name].append))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 500
    assert [o.finish_reason for o in outs["plain"] if o.finished] == ["length"]
    assert [o.finish_reason for o in outs[name] if o.finished] == ["length"]
    assert [t for o in outs["plain"] for t in o.new_token_ids] == alone
    tokens = [t for o in outs[name] for t in o.new_token_ids]
    assert len(tokens) == 6
    if name.startswith("bias"):
        assert set(tokens) <= {97, 98}
    assert_no_leak(engine)
