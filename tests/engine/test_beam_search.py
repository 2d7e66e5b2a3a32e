"""Beam search (`backend/engine/beam.py`, `Scheduler._beam_*`): transformers' `generate(
num_beams=W)` is the oracle on the trained default model (tokens, scores, the end id, length
penalty, early stopping); on every family, the engine's beams (paged KV shared through the
prefix store, forked run states and partial pages) are those of a reference search that
prefills each beam from scratch, under every cache policy, beside other requests, through
preemption (the search restarts) and cancellation, without leaking a page or a slot."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from engine_helpers import (
    PAGE,
    TINY_MODEL_DIR,
    assert_no_leak,
    make_engine,
    random_prompt,
    reference_beams,
)

from backend.cache.tier_config import TierConfig
from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request

MODEL_DIR = TINY_MODEL_DIR
PROMPTS = [
    list(b"def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
         b"\ndef fact(n):\n"),
    list(b"import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n"
         b"        self.path = path\n"),
]
PAD = 259  # transformers pads finished rows; not a byte
CHECKPOINT = (11, False)  # conftest.family_model: seed, slow decay


def hf_beams(hf, prompt, params: SamplingParams):
    """transformers' beams (generated ids up to the end id) and their scores."""
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens,
                      num_beams=params.beam_width, num_return_sequences=params.beam_width,
                      do_sample=False, length_penalty=params.length_penalty,
                      early_stopping=params.early_stopping, eos_token_id=params.end_id,
                      pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
    beams = []
    for row in ref.sequences:
        ids = [t for t in row[len(prompt):].tolist() if t != PAD]
        beams.append(ids[:ids.index(params.end_id)] if params.end_id in ids else ids)
    return beams, ref.sequences_scores.tolist()


# (beam width, max tokens, length penalty, early stopping, end id): end id 10 ("\n") ends
# beams often; 58 (":") rarely; the model's own end id never within the budget.
CASES = [
    (2, 16, 1.0, False, None),
    (4, 40, 1.0, False, 10),
    (4, 40, 0.0, True, 10),
    (5, 48, 2.0, False, 10),
    (3, 48, -1.0, False, 58),
    (6, 40, 1.0, True, 41),
]


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "w{}-n{}-lp{}-es{}-end{}".format(*c))
def test_beams_are_transformers_beams(hf, engine, prompt, case):
    width, max_tokens, penalty, early, end_id = case
    params = SamplingParams(max_tokens=max_tokens, beam_width=width, length_penalty=penalty,
                            early_stopping=early, end_id=end_id or engine.eos_token_id,
                            return_log_probs=True)
    out = engine.generate(PROMPTS[prompt], params)
    expected, scores = hf_beams(hf, PROMPTS[prompt], params)
    assert [b.token_ids for b in out.beams] == expected
    torch.testing.assert_close(torch.tensor([b.score for b in out.beams]),
                               torch.tensor(scores), atol=1e-3, rtol=0)
    best = out.beams[0]
    assert out.new_token_ids == best.token_ids and out.finish_reason == best.finish_reason
    assert out.num_output_tokens == len(best.token_ids)
    # Each beam's log probabilities are the model's (raw) ones for its tokens.
    for beam in out.beams:
        assert len(beam.log_probs) == len(beam.token_ids)
        if beam.token_ids:
            ids = torch.tensor([PROMPTS[prompt] + beam.token_ids])
            with torch.inference_mode():
                rows = hf(ids).logits[0, len(PROMPTS[prompt]) - 1:-1].float()
            raw = torch.log_softmax(rows, -1)[torch.arange(len(beam.token_ids)),
                                              torch.tensor(beam.token_ids)]
            torch.testing.assert_close(torch.tensor(beam.log_probs), raw, atol=1e-4, rtol=0)
            assert beam.cum_log_prob == pytest.approx(float(raw.sum()), abs=1e-3)
    assert_no_leak(engine)


def test_a_streamed_search_sends_its_running_beams_every_step(hf, engine):
    """stream_beams: an output at every step before the final one, carrying the running
    beams so far (best first, one token longer each step, their log probabilities the
    model's); every finished beam was one of them the step before it ended; the final
    output is the unstreamed search's."""
    params = SamplingParams(max_tokens=40, beam_width=4, end_id=10, return_log_probs=True)
    plain = engine.generate(PROMPTS[0], params)
    outs = []
    engine.submit(Request("streamed", PROMPTS[0], params, on_output=outs.append,
                          stream_beams=True))
    while engine.has_work:
        engine.step()
    *steps, final = outs
    assert final.finished and all(not o.finished and not o.new_token_ids for o in steps)
    assert [b.token_ids for b in final.beams] == [b.token_ids for b in plain.beams]
    assert final.new_token_ids == plain.new_token_ids
    assert [len(o.beams[0].token_ids) for o in steps] == list(range(1, len(steps) + 1))
    running: dict[int, list[list[int]]] = {}
    for o in steps:
        n = len(o.beams[0].token_ids)
        assert 1 <= len(o.beams) <= 4 and all(len(b.token_ids) == n for b in o.beams)
        assert all(b.finish_reason == "" for b in o.beams)
        scores = [b.score for b in o.beams]
        assert scores == sorted(scores, reverse=True)
        assert o.num_output_tokens == n
        running[n] = [b.token_ids for b in o.beams]
    for beam in final.beams:  # its parent ran the step before (an end id is not output)
        ended_at = len(beam.token_ids) + (beam.finish_reason == "eos") - 1
        if ended_at:
            assert beam.token_ids[:ended_at] in running[ended_at]
    last = steps[-1].beams[0]
    with torch.inference_mode():
        rows = hf(torch.tensor([PROMPTS[0] + last.token_ids])).logits[0, len(PROMPTS[0]) - 1:-1]
    raw = torch.log_softmax(rows.float(), -1)[torch.arange(len(last.token_ids)),
                                              torch.tensor(last.token_ids)]
    torch.testing.assert_close(torch.tensor(last.log_probs), raw, atol=1e-4, rtol=0)
    assert last.cum_log_prob == pytest.approx(float(raw.sum()), abs=1e-3)
    assert_no_leak(engine)


def test_beside_speculative_requests(hf):
    """A search decoding in the steps where other rows verify drafts (the forward returns
    several positions a row) keeps transformers' beams; the other rows keep their drafts."""
    engine = Engine.from_model_dir(MODEL_DIR, EngineConfig(
        speculative_method="ngram", speculative_adaptive=False, prompt_lookup_min=2))
    quote = list(b"The cat sat on the mat. The cat sat on the mat. The cat sat on the")
    plain = Request("plain", quote, SamplingParams(max_tokens=40, top_k=1))
    engine.submit(plain)
    params = SamplingParams(max_tokens=24, beam_width=3, end_id=engine.eos_token_id)
    out = engine.generate(PROMPTS[1], params)
    assert [b.token_ids for b in out.beams] == hf_beams(hf, PROMPTS[1], params)[0]
    while engine.has_work:
        engine.step()
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert_no_leak(engine)


def test_beams_end_on_their_own_reasons(engine):
    """The end id never is output; stop words stay in it (as for a sampled request)."""
    params = SamplingParams(max_tokens=40, beam_width=3, end_id=10,
                            stop_words=((ord("r"), ord("n")),))
    out = engine.generate(PROMPTS[0], params)
    assert {b.finish_reason for b in out.beams} <= {"eos", "stop", "length"}
    for beam in out.beams:
        assert 10 not in beam.token_ids
        if beam.finish_reason == "stop":
            assert beam.token_ids[-2:] == [ord("r"), ord("n")]
    assert "stop" in {b.finish_reason for b in out.beams}, "the case should reach a stop word"
    assert_no_leak(engine)


def test_logit_controls_follow_each_beam(engine):
    """Penalties count each beam's own tokens (a forked beam's are its parent's), bad words
    and min_tokens mask per beam: the beams of a from-scratch search under the same rules."""
    params = SamplingParams(max_tokens=40, beam_width=4, end_id=10, min_tokens=12,
                            repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.2, logit_bias=((ord("s"), -1.5),),
                            bad_words=((ord("("), ord(")")), (ord("x"),)))
    out = engine.generate(PROMPTS[0], params)
    expected = reference_beams(engine.model, PROMPTS[0], params)
    assert [b.token_ids for b in out.beams] == expected
    plain = engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, beam_width=4, end_id=10))
    assert [b.token_ids for b in plain.beams] != expected  # the controls changed the beams
    for beam in out.beams:
        assert ord("x") not in beam.token_ids and len(beam.token_ids) >= 12
    assert_no_leak(engine)


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint", "none"])
def test_every_family_every_policy(family_model, policy):
    """Beams crossing several 16-token pages (forks share the store's whole pages and copy
    the partial one), next to plain requests; then the same prompt again, from the cache."""
    vocab = family_model.config.vocab_size
    prompt = random_prompt(37, vocab, seed=3)
    params = SamplingParams(max_tokens=3 * PAGE + 5, beam_width=4, end_id=-1)
    expected = reference_beams(family_model, prompt, params)
    engine = make_engine(family_model, policy=policy, interval=PAGE)
    others = [Request(f"plain-{i}", random_prompt(20 + 9 * i, vocab, seed=10 + i),
                      SamplingParams(max_tokens=30, top_k=1)) for i in range(3)]
    for request in others:
        engine.submit(request)
    out = engine.generate(prompt, params)
    assert [b.token_ids for b in out.beams] == expected
    again = engine.generate(prompt, params)
    assert [b.token_ids for b in again.beams] == expected
    if policy != "none":
        assert again.cached_tokens > 0
    while engine.has_work:
        engine.step()
    assert_no_leak(engine)


@pytest.mark.parametrize("where", ["dram", "ssd"])
def test_beams_over_tiers(family_model, where, tmp_path):
    """Beams whose pages go down to DRAM / SSD between searches (a device pool of 24 pages),
    and a second search that hits them from there."""
    vocab = family_model.config.vocab_size
    tiers = (TierConfig(host_pages=64) if where == "dram" else
             TierConfig(host_pages=12, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m1"))
    base = make_engine(family_model, num_kv_pages=24)
    engine = Engine(family_model, replace(base.config, tiers=tiers))
    params = SamplingParams(max_tokens=2 * PAGE, beam_width=3, end_id=-1)
    prompts = [random_prompt(70, vocab, seed=40 + i) for i in range(3)]
    expected = [reference_beams(family_model, prompt, params) for prompt in prompts]
    for prompt, beams in zip(prompts, expected):
        assert [b.token_ids for b in engine.generate(prompt, params).beams] == beams
    again = engine.generate(prompts[0], params)
    assert [b.token_ids for b in again.beams] == expected[0]
    assert again.cached_tokens > 0
    assert engine.stats()["cache"]["pages_demoted"] > 0
    assert_no_leak(engine)
    engine.stop()


def test_preempted_search_restarts_to_the_same_beams(family_model):
    """Two searches and a long request in a pool too small for all: searches are preempted
    (and restart from their prompts) and still return their own beams."""
    vocab = family_model.config.vocab_size
    params = SamplingParams(max_tokens=40, beam_width=3, end_id=-1)
    prompts = [random_prompt(30 + 5 * i, vocab, seed=20 + i) for i in range(2)]
    expected = [reference_beams(family_model, p, params) for p in prompts]
    engine = make_engine(family_model, num_kv_pages=16, max_num_seqs=8)
    results, streamed = {}, {0: [], 1: []}
    for i, prompt in enumerate(prompts):  # the second streams its beams
        engine.submit(Request(f"beam-{i}", prompt, params, on_output=streamed[i].append,
                              stream_beams=i == 1))
    engine.submit(Request("long", random_prompt(60, vocab, seed=9),
                          SamplingParams(max_tokens=60, top_k=1)))
    while engine.has_work:
        engine.step()
    assert engine.stats()["preemptions"] > 0, "the pool should have been too small"
    for i in range(2):
        results[i] = streamed[i][-1]
        assert results[i].finished
        assert [b.token_ids for b in results[i].beams] == expected[i]
    assert len(streamed[0]) == 1  # not streamed: the final output only
    lengths = [len(o.beams[0].token_ids) for o in streamed[1][:-1]]
    # A restart after a preemption streams the restarted beams (lengths from 1 again); the
    # last run streamed each of its 39 steps before the final output.
    assert lengths[-39:] == list(range(1, 40))
    assert_no_leak(engine)


def test_cancel_mid_search_frees_everything(engine):
    outs = []
    engine.submit(Request("beam-cancel", PROMPTS[1], SamplingParams(max_tokens=64,
                                                                    beam_width=4, end_id=-1),
                          on_output=outs.append))
    for _ in range(6):
        engine.step()
    assert engine.stats()["active_requests"] == 4  # the search's beams are running
    engine.cancel("beam-cancel")
    while engine.has_work:
        engine.step()
    assert [o.finish_reason for o in outs] == ["cancelled"]
    # The output carries the beams so far, best first, each ended "cancelled"
    beams = outs[0].beams
    assert beams is not None and len(beams) == 4
    assert {b.finish_reason for b in beams} == {"cancelled"}
    assert len({len(b.token_ids) for b in beams}) == 1 and beams[0].token_ids
    assert [b.score for b in beams] == sorted((b.score for b in beams), reverse=True)
    assert outs[0].new_token_ids == beams[0].token_ids
    assert_no_leak(engine)


def test_a_failed_step_fails_the_search_whole(engine, monkeypatch):
    outs = []
    engine.submit(Request("beam-fail", PROMPTS[0], SamplingParams(max_tokens=32, beam_width=3),
                          on_output=outs.append))
    for _ in range(4):
        engine.step()
    real = engine.executor.forward

    def broken(*args, **kwargs):
        monkeypatch.setattr(engine.executor, "forward", real)
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.executor, "forward", broken)
    engine.step()
    assert [o.finish_reason for o in outs] == ["error"]  # one output for the request
    assert not engine.has_work
    assert_no_leak(engine)


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0), "beam_width must be in"),
    (dict(beam_width=65), "beam_width must be in"),
    (dict(beam_width=2, top_k=5), "do not apply to beam search"),
    (dict(beam_width=2, top_p=0.5), "do not apply to beam search"),
    (dict(beam_width=2, min_p=0.1), "min_p=0.1 do not apply to beam search"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty must be finite"),
])
def test_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_searches_the_engine_cannot_hold_are_refused(family_model):
    engine = make_engine(family_model, num_kv_pages=16, max_num_seqs=4)
    prompt = random_prompt(20, family_model.config.vocab_size, seed=1)
    with pytest.raises(ValueError, match="more than the engine's max_num_seqs=4"):
        engine.submit(Request("wide", prompt, SamplingParams(max_tokens=8, beam_width=5)))
    with pytest.raises(ValueError, match="the pool holds 16"):
        engine.submit(Request("long", prompt, SamplingParams(max_tokens=60, beam_width=4)))
    assert_no_leak(engine)
    # an anchor pool smaller than a request's pages: it failed inside the step, every time
    small = make_engine(family_model, num_kv_pages=16, num_anchor_blocks=1)
    with pytest.raises(ValueError, match=r"needs 2 anchor blocks, the pool holds 1 "
                                         r"\(num_anchor_blocks\)"):
        small.submit(Request("anchors", prompt, SamplingParams(max_tokens=8)))
    assert_no_leak(small)


@pytest.mark.parametrize("penalty", [1100.0, 300.0, -1e30])
def test_an_extreme_length_penalty_saturates_instead_of_failing(engine, penalty):
    """length ** length_penalty beyond the float range (OverflowError; or 0.0, then a
    division by zero) ended the step, and with it every request in the batch: the score now
    saturates. A greedy request decoding beside the search keeps its tokens."""
    plain = SamplingParams(max_tokens=24, top_k=1)
    alone = engine.generate(PROMPTS[0], plain).new_token_ids
    outs = {"plain": [], "beam": []}
    engine.submit(Request("lp-plain", PROMPTS[0], plain, on_output=outs["plain"].append))
    engine.submit(Request("lp-beam", PROMPTS[0], SamplingParams(
        max_tokens=16, beam_width=2, length_penalty=penalty, end_id=10),
        on_output=outs["beam"].append))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 500
    assert [t for o in outs["plain"] for t in o.new_token_ids] == alone
    final = outs["beam"][-1]
    assert final.finished and final.finish_reason in ("length", "stop", "eos")
    assert len(final.beams) == 2 and not any(math.isnan(b.score) for b in final.beams)
    assert all(b.finish_reason in ("length", "stop", "eos") for b in final.beams)
    assert_no_leak(engine)
