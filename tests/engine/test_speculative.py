"""Speculative decoding (n-gram prompt lookup, `backend/engine/speculative.py`): drafts are
what a brute-force search proposes, and the engine's outputs with drafts are those without:
greedy tokens and their log probabilities, every stop rule, guides, bad words, seeded
sampling. The random
workloads (`test_random_workloads.py`, configurations `*+spec`) check every token against the
model under preemption, tiers and the checkpoint baseline."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_no_leak

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.guided import Guide
from backend.engine.request import Request
from backend.engine.speculative import (
    REPROBE_EVERY,
    DraftPolicy,
    NgramDrafter,
    NgramIndex,
    Prediction,
    expected_tokens,
)
from backend.model import SeqInput

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repo/hybrid_llm/1/tiny_qwen3_5"
# Every proposal verified whole (the adaptive cut depends on measured times: tested apart).
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
            prompt_lookup_max=6, speculative_adaptive=False)
PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "Once upon a time there was a little girl. Once upon a time there",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Q: What is the capital of France?\nA: Paris.\nQ: What is the capital of Spain?\nA:",
    "zqx vbn plm",  # little to look up
]


def reference_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest earlier match (min_n..max_n tokens, the latest among equals) of the
    sequence's last tokens, found by comparing every position; the k tokens after it, read
    on into the draft itself where the match runs up to the end."""
    L = len(tokens)
    best, best_len = None, 0
    for i in range(L - 1, 0, -1):  # i: the position after the earlier occurrence
        m = 0
        while m < max_n and i - m - 1 >= 0 and tokens[i - m - 1] == tokens[L - m - 1]:
            m += 1
        if m >= min_n and m > best_len:
            best, best_len = i, m
    if best is None:
        return []
    seq = list(tokens)
    for j in range(k):
        seq.append(seq[best + j])
    return seq[L:]


def test_ngram_drafts_are_the_brute_force_ones():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        vocab = rng.choice((2, 3, 5, 20))
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 5)
        index = NgramIndex(min_n)
        # Built incrementally as a sequence grows, then asked: the same as built at once.
        for cut in sorted({rng.randint(0, len(tokens)), len(tokens)}):
            got = index.propose(tokens[:cut], max_n, k)
            assert got == reference_draft(tokens[:cut], min_n, max_n, k), (tokens[:cut], min_n,
                                                                           max_n, k)
            checked += bool(got)
    assert checked > 100


def test_a_periodic_sequence_drafts_its_period():
    index = NgramIndex(2)
    assert index.propose([7, 8, 9, 7, 8, 9, 7, 8], max_n=8, k=5) == [9, 7, 8, 9, 7]
    assert index.propose([1, 1], max_n=4, k=3) == []  # the key's only occurrence is the end
    assert NgramIndex(1).propose([1, 1], max_n=4, k=3) == [1, 1, 1]


class _Seq:
    def __init__(self, tokens):
        self.tokens, self.ngram_index = tokens, None


def test_drafter_respects_its_limit():
    drafter = NgramDrafter(num_tokens=4, min_n=1, max_n=3)
    seq = _Seq([1, 2, 3, 1, 2, 3, 1])
    assert drafter.propose(seq, limit=10) == [2, 3, 1, 2]
    assert drafter.propose(seq, limit=2) == [2, 3]
    assert drafter.propose(seq, limit=0) == []


@pytest.fixture(scope="module")
def engines():
    plain = Engine.from_model_dir(MODEL_DIR, EngineConfig())
    spec = Engine.from_model_dir(MODEL_DIR, EngineConfig(**SPEC))
    yield plain, spec
    for e in (plain, spec):
        assert_no_leak(e)


def _run_batch(engine: Engine, prompts: list[list[int]],
               params: list[SamplingParams]) -> list[dict]:
    """Submits every request at once (one batch) and steps the engine to the end; each
    request's token ids, log probabilities, finish reason and output count."""
    results = [dict(tokens=[], log_probs=[], tops=[], reason=None, outputs=0)
               for _ in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        def collect(out, r=results[i]):
            r["tokens"] += out.new_token_ids
            r["log_probs"] += out.log_probs
            r["tops"] += out.top_log_probs
            r["outputs"] += 1
            if out.finished:
                r["reason"], r["cum"] = out.finish_reason, out.cum_log_prob
        engine.submit(Request(f"r{i}-{random.random()}", prompt, p, on_output=collect))
    while engine.has_work:
        engine.step()
    engine.scheduler.after_outputs()
    return results


def _spec_stats(engine: Engine) -> tuple[int, int]:
    s = engine.stats()
    return s["spec_draft_tokens"], s["spec_accepted_tokens"]


def test_greedy_outputs_and_log_probs_equal_a_token_a_step(engines):
    plain, spec = engines
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS]
    params = [SamplingParams(max_tokens=m, top_k=1, return_log_probs=True, top_log_probs=top)
              for m, top in ((80, 3), (64, 0), (96, 0), (40, 5), (50, 0))]
    drafts0, kept0 = _spec_stats(spec)
    steps0 = spec.stats()["steps"]
    want = _run_batch(plain, prompts, params)
    got = _run_batch(spec, prompts, params)
    drafts, kept = _spec_stats(spec)
    assert 0 < kept - kept0 < drafts - drafts0  # drafts kept and rejected
    assert spec.scheduler.num_rewinds > 0  # rejections' states rebuilt from the step's log
    for w, g in zip(want, got):
        assert g["tokens"] == w["tokens"] and g["reason"] == w["reason"] == "length"
        torch.testing.assert_close(g["log_probs"], w["log_probs"], atol=1e-4, rtol=1e-4)
        assert g["cum"] == pytest.approx(w["cum"], abs=1e-3)
        assert len(g["tops"]) == len(w["tops"]) == (len(g["tokens"]) if w["tops"] else 0)
        for gt, wt in zip(g["tops"], w["tops"]):  # alternatives of a position drafted or not
            assert [i for i, _ in gt] == [i for i, _ in wt]
            torch.testing.assert_close([v for _, v in gt], [v for _, v in wt], atol=1e-4,
                                       rtol=1e-4)
    # Several tokens an output: fewer steps than tokens (80 + 64 + ... in 5 requests).
    assert spec.stats()["steps"] - steps0 < max(p.max_tokens for p in params) - 10


def test_without_the_fast_path_rejected_drafts_are_computed_again(engines):
    """Where a step runs the general layers (no recurrence log: CUDA, bfloat16, long rows), a
    rejected draft's sequence gets its states from before the step back and computes the
    tokens it kept again: the same outputs."""
    plain, _ = engines
    general = Engine.from_model_dir(MODEL_DIR, EngineConfig(**SPEC))
    general.model.fast_decode = None
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS]
    params = [SamplingParams(max_tokens=60, top_k=1)] * len(prompts)
    want = _run_batch(plain, prompts, params)
    assert [g["tokens"] for g in _run_batch(general, prompts, params)] == \
        [w["tokens"] for w in want]
    drafts, kept = _spec_stats(general)
    assert 0 < kept < drafts and general.scheduler.num_rewinds == 0
    assert_no_leak(general)


def test_adaptive_drafts_keep_the_outputs(engines):
    """The default engine (drafts cut to what the measured step times make worth it): the
    lengths it verifies change from step to step, its outputs do not."""
    plain, _ = engines
    adaptive = Engine.from_model_dir(MODEL_DIR, EngineConfig(speculative_method="ngram"))
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS]
    params = [SamplingParams(max_tokens=80, top_k=1)] * len(prompts)
    want = _run_batch(plain, prompts, params)
    for _ in range(2):
        assert [g["tokens"] for g in _run_batch(adaptive, prompts, params)] == \
            [w["tokens"] for w in want]
    assert _spec_stats(adaptive)[1] > 0  # lengths never measured are tried
    assert_no_leak(adaptive)


@pytest.mark.parametrize("case", ["stop_words", "end_id", "min_tokens", "max_tokens",
                                  "penalties", "bad_words"])
def test_stop_rules_and_logit_controls_are_those_of_a_token_a_step(engines, case):
    plain, spec = engines
    enc = plain.tokenizer.encode
    prompts = [enc(t) for t in PROMPTS[:3]]
    if case == "stop_words":  # words the greedy outputs reach after drafts were kept
        p = SamplingParams(max_tokens=90, top_k=1, stop_words=(enc(" the caths"),
                                                                enc("\n\nclass")))
    elif case == "end_id":
        p = SamplingParams(max_tokens=90, top_k=1, end_id=enc("s")[0], min_tokens=5)
    elif case == "min_tokens":
        p = SamplingParams(max_tokens=90, top_k=1, end_id=enc(" ")[0], min_tokens=30)
    elif case == "max_tokens":  # a limit that falls inside a draft
        p = SamplingParams(max_tokens=23, top_k=1)
    elif case == "penalties":
        p = SamplingParams(max_tokens=60, top_k=1, repetition_penalty=1.1,
                           frequency_penalty=0.05, logit_bias=((enc("e")[0], 0.5),))
    else:
        p = SamplingParams(max_tokens=60, top_k=1, bad_words=(enc("cat"), enc("a +")))
    want = _run_batch(plain, prompts, [p] * len(prompts))
    got = _run_batch(spec, prompts, [p] * len(prompts))
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert [g["reason"] for g in got] == [w["reason"] for w in want]
    if case in ("stop_words", "end_id"):
        assert {"stop", "eos"} & {w["reason"] for w in want}  # the rule did end some


def test_guided_outputs_with_drafts_follow_the_grammar_and_equal_a_token_a_step(engines):
    plain, spec = engines
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "city": {"type": "string", "maxLength": 16}},
              "required": ["name", "city"]}
    prompt = plain.tokenizer.encode('{"name": "Alice Smith", "city": "Paris"}\n'
                                    '{"name": "Alice Smith", "city": "Paris"}\n')
    p = SamplingParams(max_tokens=60, top_k=1, guide=Guide("json_schema", json.dumps(schema)))
    out = [_run_batch(engine, [prompt], [p])[0] for engine in (plain, spec)]
    assert out[1]["tokens"] == out[0]["tokens"]
    json.loads(plain.tokenizer.decode(out[1]["tokens"]))


def test_seeded_sampling_draws_what_a_token_a_step_draws(engines):
    """A row draws once a token from its own generator, position by position, whether the
    positions come in one step or several: seeded outputs are the same tokens with drafts and
    without (so a draft token is kept with exactly its probability under the model)."""
    plain, spec = engines
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS[:3]] * 16
    params = [SamplingParams(max_tokens=12, temperature=t, top_p=p, seed=1000 + s)
              for s, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0)] * 16)]
    drafts0, kept0 = _spec_stats(spec)
    want = _run_batch(plain, prompts, params)
    got = _run_batch(spec, prompts, params)
    drafts, kept = _spec_stats(spec)
    assert 0 < kept - kept0 < drafts - drafts0
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert len({tuple(w["tokens"]) for w in want}) > 10  # they did sample


def test_seeded_guided_sampling_draws_what_a_token_a_step_draws(engines):
    """Tokens a grammar forces after a drawn one are appended without a draw (jump-forward);
    where a draft covered them they were verified through a draw, which moved the seeded
    generator: 11 of these 12 requests sampled other tokens after the forced words."""
    plain, spec = engines
    text = "Alice Smith lives in Paris and likes cats. Alice Smith lives in Paris and likes "
    prompt = plain.tokenizer.encode(text + "cats. ")
    regex = r"(Alice|Bob) Smith lives in (Paris|Rome) and likes (cats|dogs|fish)\. [a-z]{12}"
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=7 + s,
                             guide=Guide("regex", regex)) for s in range(12)]
    forced0 = spec.stats()["guided_forced_tokens"]
    drafts0, kept0 = _spec_stats(spec)
    want = _run_batch(plain, [prompt] * 12, params)
    got = _run_batch(spec, [prompt] * 12, params)
    assert _spec_stats(spec)[1] > kept0 and spec.stats()["guided_forced_tokens"] > forced0
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert len({tuple(w["tokens"]) for w in want}) > 6  # they did sample


def test_a_preempted_request_with_a_prediction_resumes_without_leaking_a_state_slot():
    """A preempted request whose pages were dropped meanwhile computes its 137 tokens again
    as one chunk, with a planned state at 128. That chunk took a draft from the request's
    prediction; rejected, the chunk (too long to rewind) was planned again and its state's
    first slot was never freed. Now such a chunk takes no draft, and a state planned again
    gives its first slot back."""
    engine = Engine.from_model_dir(MODEL_DIR, EngineConfig(speculative_adaptive=False,
                                                           max_num_seqs=1))
    prompt = engine.tokenizer.encode(PROMPTS[0])
    greedy = SamplingParams(max_tokens=120, top_k=1)
    want = engine.generate(prompt, greedy).new_token_ids
    engine.reset_prefix_cache()
    outs = []
    engine.submit(Request("a", prompt, greedy, on_output=outs.append,
                          prediction=want[:72] + [ord("#")] * 48))  # wrong after 72
    sched = engine.scheduler
    while sched.running[0].num_output_tokens < 70 if sched.running else engine.has_work:
        engine.step()
        sched.after_outputs()
    engine.submit(Request("urgent", engine.tokenizer.encode("zzz"),
                          SamplingParams(max_tokens=2, top_k=1), priority=-1))
    engine.step()  # "urgent" takes the only slot: "a" is preempted
    assert sched.num_preemptions == 1
    engine.reset_prefix_cache()  # (or its pages evicted while it waits)
    while engine.has_work:
        engine.step()
        sched.after_outputs()
    assert [t for o in outs for t in o.new_token_ids] == want
    engine.reset_prefix_cache()
    assert_no_leak(engine)


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_a_drafted_answer_saves_the_states_a_token_a_step_saves(engines, policy):
    """A decode saves its state at each page boundary it reaches, so the next turn resumes
    exactly where the answer's last whole page ends. A verified draft moved up to 5 tokens a
    step and stepped over those boundaries: the next turn replayed anchors (suffix replay)
    or resumed a page earlier (checkpoint). Drafts now stop at the boundary."""
    from backend.cache.config import CacheConfig

    got = []
    for config in (EngineConfig(), EngineConfig(**SPEC)):
        engine = Engine.from_model_dir(MODEL_DIR, replace(config, cache=CacheConfig(
            policy=policy, page_size=16)))
        prompt = engine.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[2])
        answer = engine.generate(prompt, SamplingParams(max_tokens=100, top_k=1))
        turn = prompt + answer.new_token_ids + engine.tokenizer.encode(" and then")
        out = engine.generate(turn, SamplingParams(max_tokens=8, top_k=1))
        computed = len(prompt) + len(answer.new_token_ids) - 1  # (the last one was not)
        got.append((out.cached_tokens, out.replayed_anchors, out.new_token_ids))
        if config.speculative_method == "ngram":
            assert _spec_stats(engine)[1] > 20  # drafts were kept
        engine.reset_prefix_cache()
        assert_no_leak(engine)
    plain, drafted = got
    assert plain[:2] == (computed // 16 * 16, 0)  # the answer's last boundary
    assert drafted == plain


def test_speculative_settings_are_checked():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="executor 'torch'"):
        EngineConfig(speculative_method="ngram", executor="compiled")
    config = EngineConfig.from_params({"speculative_method": "ngram",
                                       "num_speculative_tokens": "6"})
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 6)


def test_executor_logits_at_several_positions_are_the_full_forward_ones(engines):
    """`forward(num_logits=...)`: each row's last n positions, batched with one-token rows
    and split by length, equal a plain forward's logits at those positions."""
    plain, _ = engines
    model, ex = plain.model, plain.executor
    rng = random.Random(3)
    rows = [[rng.randrange(200) for _ in range(n)] for n in (5, 1, 130, 9)]
    num_logits = [4, 1, 3, 2]  # at most the step's tokens (all but the first)
    # Pages and slots no request holds (the engine is idle): prefill each row's first
    # token, then the rest as one step.
    seqs0, seqs = [], []
    for b, row in enumerate(rows):
        table = torch.tensor(plain.store.alloc_pages(3, with_anchors=False).kv_pages)
        ex.reset_state(b)
        seqs0.append(SeqInput(row[:1], 0, table, b))
        seqs.append(SeqInput(row[1:] if len(row) > 1 else [7], 1, table, b))
    try:
        ex.forward(seqs0)
        got = ex.forward(seqs, num_logits=num_logits)
        for b, (row, n) in enumerate(zip(rows, num_logits)):
            full = row if len(row) > 1 else row + [7]
            want = model.logits(torch.tensor([full]))[0, -n:].float()
            torch.testing.assert_close(got[b, :n], want, atol=1e-4, rtol=1e-4)
            assert not got[b, n:].any(), (b, n, got.shape)
        with pytest.raises(ValueError, match="logits"):
            ex.forward(seqs, num_logits=[5, 1, 3, 2])
    finally:
        plain.store.free_pages([p for s in seqs for p in s.page_table.tolist()], [])


class _Record:
    draft_kept = draft_rejections = 0


def test_the_draft_policy_verifies_what_pays_for_itself():
    policy = DraftPolicy(max_tokens=4)
    good, bad = _Record(), _Record()
    assert policy.choose(8, [(4, 0.9)]) == 0  # nothing measured: a plain step first
    for tokens, ms in ((1, 10.0), (1, 10.0), (2, 10.5), (2, 10.5), (3, 11.0), (3, 11.0),
                       (4, 40.0), (4, 40.0), (5, 50.0), (5, 50.0)):
        policy.record(8, tokens, ms / 1000)  # each length's first time is left out
    assert policy.estimate(8, 1) == pytest.approx(0.010)
    assert policy.estimate(4, 1) is None  # other row counts are measured apart
    # Two or three tokens a row cost 5-10% more: worth it for rows that keep most of their
    # drafts (the longer the better); four or more cost 4-5x: not worth it.
    policy.settled(good, kept=9, rejected=True)
    assert policy.accept_rate(good) > 0.7
    assert policy.choose(8, [(4, policy.accept_rate(good))] * 4) == 2
    for _ in range(12):
        policy.settled(bad, kept=0, rejected=True)
    assert policy.accept_rate(bad) < 0.3
    assert policy.choose(8, [(4, policy.accept_rate(bad))] * 4) == 0
    # A length never measured is tried (as if it cost what one token does).
    policy.record(1, 1, 0.010)
    policy.record(1, 1, 0.010)
    assert policy.choose(1, [(4, 0.5)]) == 4
    # Every REPROBE_EVERY-th decision sends the longest drafts, whatever the estimates.
    while policy.decisions % REPROBE_EVERY != REPROBE_EVERY - 1:
        policy.choose(8, [(4, 0.1)])
    assert policy.choose(8, [(3, 0.1)]) == 3


def test_a_measured_step_time_is_the_median_of_recent_ones():
    policy = DraftPolicy(max_tokens=2)
    for ms in (500.0, 10.0, 11.0, 300.0, 12.0):  # 500: the first, left out
        policy.record(2, 3, ms / 1000)
    assert policy.estimate(2, 3) == pytest.approx(0.0115)


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0


def test_a_prediction_is_found_again_after_the_output_leaves_it():
    predicted = list(range(100, 120))
    p = Prediction(predicted, 3)
    assert p.propose([], 4) == [100, 101, 102, 103]  # the output starts it
    assert p.propose([100, 101], 3) == [102, 103, 104]
    assert p.propose([100, 7], 3) == []  # left it before n tokens: nothing to align
    assert p.propose([100, 101, 102, 103], 2) == [104, 105]
    edited = [100, 101, 102, 103, 9, 9, 9, 107, 108, 109]  # an edit, then the prediction again
    assert p.propose(edited[:6], 4) == []
    assert p.propose(edited, 4) == [110, 111, 112, 113]
    assert p.propose(list(range(100, 120)), 4) == []  # at its end
    # A repeated n-gram: the place the output would be at had it followed the prediction.
    loop = Prediction([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6], 3)
    assert loop.propose([1, 2, 3], 1) == [4]
    assert loop.propose([1, 2, 3, 4, 1, 2, 3], 1) == [5]
    assert loop.propose([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 1) == [6]
    again = Prediction([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6], 3)
    assert again.propose([1, 2, 3, 4], 1) == [1]
    assert again.propose([1, 2, 3, 4, 8, 8, 8, 8, 1, 2, 3], 1) == [6]  # 7 tokens on
    assert Prediction([], 3).propose([1], 4) == [] and p.propose([100], 0) == []


def _predicted_run(engine: Engine, prompt: list[int], params: SamplingParams,
                   prediction: list[int] | None) -> tuple[list[int], int, int]:
    """(tokens, steps taken, draft tokens kept) of one request run alone."""
    outs: list = []
    steps, (_, kept0) = engine.stats()["steps"], _spec_stats(engine)
    engine.submit(Request(f"p-{random.random()}", prompt, params, on_output=outs.append,
                          prediction=prediction))
    while engine.has_work:
        engine.step()
    engine.scheduler.after_outputs()
    return ([t for o in outs for t in o.new_token_ids], engine.stats()["steps"] - steps,
            _spec_stats(engine)[1] - kept0)


def test_a_prediction_drafts_for_its_request_whatever_the_engines_method(engines):
    """Request.prediction (OpenAI's predicted outputs): on an engine without speculative
    decoding, the request's output drafts from it: the same tokens in fewer steps; an edited
    prediction still drafts after the edit; a wrong one changes nothing but the time;
    seeded sampling draws the same tokens."""
    plain, _ = engines
    engine = Engine.from_model_dir(MODEL_DIR, EngineConfig(speculative_adaptive=False))
    prompt = plain.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=60, top_k=1)
    want, steps, kept = _predicted_run(engine, prompt, params, None)
    assert kept == 0 and steps >= 60
    exact, exact_steps, exact_kept = _predicted_run(engine, prompt, params, want)
    assert exact == want and exact_kept >= 40 and exact_steps < steps // 2
    edited = want[:20] + [ord("#")] * 6 + want[24:]  # 4 tokens replaced by 6 others
    got, _, edited_kept = _predicted_run(engine, prompt, params, edited)
    assert got == want and edited_kept > 30  # drafts after the edit too
    wrong = plain.tokenizer.encode("zzzz qqqq " * 8)
    assert _predicted_run(engine, prompt, params, wrong)[0] == want
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=7)
    sampled = _predicted_run(engine, prompt, seeded, None)[0]
    assert _predicted_run(engine, prompt, seeded, sampled)[0] == sampled
    assert _predicted_run(engine, prompt, seeded, want)[0] == sampled
    with pytest.raises(ValueError, match="the prediction holds token ids"):
        engine.submit(Request("bad", prompt, params, prediction=[10**9]))
    assert_no_leak(engine)
