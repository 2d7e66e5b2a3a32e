"""Admission order (`schedule_policy`): "fcfs" admits waiting requests in arrival order,
"lpm" the one with the longest cached prefix first (SGLang's cache-aware order)."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import pytest
from engine_helpers import GREEDY, assert_no_leak, make_engine, random_prompt
from hf_oracle import make_hf_checkpoint

from backend.cache.radix import encode_tokens
from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request
from backend.engine.sequence import Sequence
from backend.model import load_model
from backend.model.generate import greedy_generate
from backend.replay.budget import ReplayConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("schedule-model")
    make_hf_checkpoint(path, seed=3)
    return load_model(path)


def _serve_queue(model, policy: str, pause: float = 0.0,
                 **config) -> tuple[list[str], dict, Engine]:
    """One running slot: while a request holds it, a miss and then (`pause` seconds later) a
    hit on a cached prompt wait. Returns the order of their first tokens, their tokens and
    the engine."""
    base = make_engine(model, max_num_seqs=1)
    engine = Engine(model, replace(base.config, schedule_policy=policy, **config))
    vocab = model.config.vocab_size
    cached = random_prompt(160, vocab, seed=10)
    engine.generate(cached, GREEDY)
    order: list[str] = []
    tokens: dict = {}

    def submit(rid, prompt, max_tokens):
        tokens[rid] = []

        def collect(out):
            if out.new_token_ids and rid not in order:
                order.append(rid)
            tokens[rid].extend(out.new_token_ids)
            if out.finished:
                tokens[rid, "cached"] = out.cached_tokens
        sampling = SamplingParams(max_tokens=max_tokens, top_k=1, end_id=-1)
        engine.submit(Request(rid, prompt, sampling, on_output=collect))

    submit("running", random_prompt(40, vocab, seed=11), 6)
    engine.step()  # admitted: the only slot is taken
    submit("miss", random_prompt(100, vocab, seed=12), 3)
    time.sleep(pause)
    tokens["hit prompt"] = cached[:128] + random_prompt(20, vocab, seed=13)
    submit("hit", tokens["hit prompt"], 3)
    while engine.has_work:
        engine.step()
    return order, tokens, engine


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_in_arrival_order(model):
    order, lpm, engine = _serve_queue(model, "lpm")
    assert order == ["running", "hit", "miss"]
    assert lpm["hit", "cached"] == 128 and lpm["miss", "cached"] == 0
    assert_no_leak(engine)
    order, fcfs, engine = _serve_queue(model, "fcfs")
    assert order == ["running", "miss", "hit"]
    assert_no_leak(engine)
    for rid in ("running", "miss", "hit"):
        assert lpm[rid] == fcfs[rid]  # the order changes, never the tokens
    want = greedy_generate(model, [lpm["hit prompt"]], max_new_tokens=3, page_size=16)[0]
    assert lpm["hit"] == want


def test_lpm_serves_requests_past_their_wait_bound_first(model):
    # Every waiting request past the bound: plain arrival order.
    order, tokens, engine = _serve_queue(model, "lpm", lpm_max_wait_s=0.0)
    assert order == ["running", "miss", "hit"]
    assert tokens["hit", "cached"] == 128
    assert_no_leak(engine)
    # The miss waited past the bound, the hit (1.1 s later) did not: the miss goes first.
    order, _, engine = _serve_queue(model, "lpm", pause=1.1, lpm_max_wait_s=1.0)
    assert order == ["running", "miss", "hit"]
    assert_no_leak(engine)
    # Both within it: the cached prefix first.
    order, _, engine = _serve_queue(model, "lpm", pause=1.1, lpm_max_wait_s=60.0)
    assert order == ["running", "hit", "miss"]


def test_a_sequence_matches_its_tokens_but_the_last_as_they_grow():
    seq = Sequence(Request("r", [1, 2, 3]), [1, 2, 3], 3)
    assert seq.prefix_key() == encode_tokens([1, 2])
    seq.tokens.append(4)  # a preempted sequence re-enters the queue with its outputs
    assert seq.prefix_key() == encode_tokens([1, 2, 3])


def test_schedule_policy_is_checked_and_read_from_parameters():
    with pytest.raises(ValueError, match=r"schedule_policy must be one of \('fcfs', 'lpm'\)"):
        EngineConfig(schedule_policy="sjf")
    assert EngineConfig.from_params({"schedule_policy": "lpm"}).schedule_policy == "lpm"
    assert EngineConfig.from_params({}).schedule_policy == "fcfs"
    assert EngineConfig.from_params({"lpm_max_wait_s": "2.5"}).lpm_max_wait_s == 2.5
    with pytest.raises(ValueError, match=r"lpm_max_wait_s must be >= 0 seconds, got -1"):
        EngineConfig(lpm_max_wait_s=-1.0)


def _run(engine: Engine, requests: list[tuple[str, list[int], int, int]],
         between=None) -> tuple[list[str], list[str], dict]:
    """Submits (id, prompt, max_tokens, priority) requests (after the first's admission when
    `between` is set: then calls it and submits the rest); returns the order of first tokens,
    the order of finishing and each one's tokens."""
    first, done, tokens = [], [], {}

    def submit(rid, prompt, max_tokens, priority):
        tokens[rid] = []

        def collect(out):
            if out.new_token_ids and rid not in first:
                first.append(rid)
            tokens[rid].extend(out.new_token_ids)
            if out.finished:
                done.append(rid)
        engine.submit(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, top_k=1,
                                                          end_id=-1),
                              on_output=collect, priority=priority))

    submit(*requests[0])
    if between is not None:
        between()
    for r in requests[1:]:
        submit(*r)
    while engine.has_work:
        engine.step()
    return first, done, tokens


def test_waiting_requests_go_by_priority_then_arrival(model):
    engine = make_engine(model, max_num_seqs=1)
    vocab = model.config.vocab_size
    p = [random_prompt(30, vocab, seed=20 + i) for i in range(4)]
    # the running one is the most urgent: nothing preempts it
    first, _, _ = _run(engine, [("running", p[0], 4, -5), ("low", p[1], 2, 3),
                                ("mid", p[2], 2, 1), ("mid2", p[3], 2, 1)],
                       between=engine.step)
    assert first == ["running", "mid", "mid2", "low"]
    assert_no_leak(engine)


def test_an_urgent_request_takes_the_slot_of_a_less_urgent_one_whose_tokens_stay_right(model):
    engine = make_engine(model, max_num_seqs=1)
    vocab = model.config.vocab_size
    slow, fast = random_prompt(40, vocab, seed=30), random_prompt(30, vocab, seed=31)

    def started():
        for _ in range(4):  # admitted, prefilled, a few tokens out
            engine.step()

    first, done, tokens = _run(engine, [("batch", slow, 16, 2), ("chat", fast, 3, 0)],
                               between=started)
    assert first == ["batch", "chat"] and done == ["chat", "batch"]
    assert engine.scheduler.num_preemptions == 1
    want = greedy_generate(model, [slow, fast], max_new_tokens=16, page_size=16)
    assert tokens["batch"] == want[0] and tokens["chat"] == want[1][:3]
    assert_no_leak(engine)
    # equal priorities: no preemption, arrival order
    first, done, _ = _run(engine, [("batch", slow, 16, 0), ("chat", fast, 3, 0)],
                          between=started)
    assert done == ["batch", "chat"] and engine.scheduler.num_preemptions == 1


def test_out_of_pages_the_least_urgent_is_preempted_even_if_older(model):
    vocab = model.config.vocab_size
    a, b = random_prompt(40, vocab, seed=40), random_prompt(40, vocab, seed=41)
    orders = {}
    for name, (pa, pb) in {"by_age": (0, 0), "by_priority": (1, 0)}.items():
        engine = make_engine(model, max_num_seqs=2, num_kv_pages=9)
        _, done, tokens = _run(engine, [("old", a, 40, pa), ("young", b, 40, pb)])
        assert engine.scheduler.num_preemptions >= 1, name
        orders[name] = done
        want = greedy_generate(model, [a, b], max_new_tokens=40, page_size=16)
        assert tokens["old"] == want[0] and tokens["young"] == want[1]
        assert_no_leak(engine)
    assert orders == {"by_age": ["old", "young"], "by_priority": ["young", "old"]}


def _aging_run(model, aging: float, prompts: list[list[int]]) -> list[str]:
    """A request running, a batch request (priority 3), 0.5 s later two urgent ones (0), one
    slot: the order of first tokens (checks the queue's order, and that nothing is
    preempted)."""
    base = make_engine(model, max_num_seqs=1)
    engine = Engine(model, replace(base.config, priority_aging_s=aging))
    first: list[str] = []

    def submit(rid, prompt, priority):
        def collect(out):
            if out.new_token_ids and rid not in first:
                first.append(rid)
        engine.submit(Request(rid, prompt, SamplingParams(max_tokens=3, top_k=1, end_id=-1),
                              on_output=collect, priority=priority))

    submit("running", prompts[0], 0)
    engine.step()
    submit("batch", prompts[1], 3)
    time.sleep(0.5)
    submit("chat1", prompts[2], 0)
    submit("chat2", prompts[3], 0)
    engine.step()
    waiting = {s.request.request_id: s for s in engine.scheduler.waiting}
    assert list(waiting) == (["batch", "chat1", "chat2"] if aging else
                             ["chat1", "chat2", "batch"])
    level = engine.scheduler.urgency(waiting["batch"], time.perf_counter())
    assert level <= -2 if aging else level == 3
    while engine.has_work:
        engine.step()
    assert engine.scheduler.num_preemptions == 0
    assert_no_leak(engine)
    return first


def test_priority_aging_lets_a_long_waiting_request_go_before_newer_urgent_ones(model):
    """With `priority_aging_s`, a request that waited climbs a level each period: a batch
    request queued 0.5 s before two urgent ones goes first at 0.1 s a level (5 levels past
    its 3), last without aging; and once running, the younger urgent ones (less urgent by
    then) do not take its slot."""
    vocab = model.config.vocab_size
    prompts = [random_prompt(30, vocab, seed=50 + i) for i in range(4)]
    assert _aging_run(model, 0.0, prompts) == ["running", "chat1", "chat2", "batch"]
    assert _aging_run(model, 0.1, prompts) == ["running", "batch", "chat1", "chat2"]
    assert EngineConfig.from_params({"priority_aging_s": "2"}).priority_aging_s == 2.0
    for bad in (-1.0, 1e-320):  # (1e-320: an infinite bonus, which failed every step)
        with pytest.raises(ValueError, match=r"priority_aging_s must be 0 \(off\) or at least"):
            EngineConfig(priority_aging_s=bad)


def test_priority_must_be_an_integer(model):
    engine = make_engine(model)
    for bad in (1.5, "1", True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.submit(Request("r", [1, 2], priority=bad))


def test_an_urgent_request_waiting_for_a_running_prefill_preempts_nothing_until_it_ends(model):
    """The urgent request shares the running one's prompt: it waits for that prefill
    (`share_running_prefills`) instead of throwing it away, then takes the slot and resumes
    from the pages it left."""
    engine = make_engine(model, max_num_seqs=1, max_tokens_per_step=64)
    vocab = model.config.vocab_size
    shared = random_prompt(320, vocab, seed=50)
    cached = {}

    def between():
        engine.step()  # the first 64 of the long prompt

    def collect_cached(rid):
        def on_output(out):
            if out.finished:
                cached[rid] = out.cached_tokens
        return on_output

    engine.submit(Request("long", shared + [1], SamplingParams(max_tokens=24, top_k=1,
                                                               end_id=-1),
                          on_output=collect_cached("long"), priority=5))
    between()
    engine.submit(Request("urgent", shared + [2, 3], SamplingParams(max_tokens=3, top_k=1,
                                                                    end_id=-1),
                          on_output=collect_cached("urgent"), priority=0))
    while engine.has_work:
        engine.step()
    assert cached["urgent"] >= 304  # the long prompt's pages, prefilled once
    assert engine.scheduler.num_preemptions == 1  # once its prefill was done
    assert_no_leak(engine)


def test_prefills_that_fill_the_pool_with_their_own_pages_preempt_rather_than_stall(model):
    """Every running request prefilling (a preempted one computing its tokens again beside
    new prompts) and their own pages filling the pool: no row could get a page and only
    decode rows preempted, so every later step was empty, forever. Now the least urgent is
    preempted and the others go on; every output is the greedy one."""
    vocab = model.config.vocab_size
    engine = make_engine(model, max_num_seqs=3, num_kv_pages=7, max_tokens_per_step=32,
                         replay=ReplayConfig.exact())
    # (arrival step, prompt length, max tokens, priority)
    plan = [(1, 44, 3, 0), (3, 51, 33, 1), (7, 23, 30, 1), (9, 69, 32, 0)]
    prompts = [random_prompt(n, vocab, seed=80 + i) for i, (_, n, _, _) in enumerate(plan)]
    tokens: dict[int, list[int]] = {i: [] for i in range(len(plan))}
    ends: dict[int, str] = {}

    def collect(i, out):
        tokens[i].extend(out.new_token_ids)
        if out.finished:
            ends[i] = out.finish_reason

    for step in range(400):
        for i, (at, _, max_tokens, priority) in enumerate(plan):
            if at == step:
                engine.submit(Request(f"r{i}", prompts[i], SamplingParams(
                    max_tokens=max_tokens, top_k=1, end_id=-1), priority=priority,
                    on_output=partial(collect, i)))
        if step > plan[-1][0] and not engine.has_work:
            break
        engine.step()
    assert ends == {i: "length" for i in range(len(plan))}, (ends, engine.stats())
    assert engine.scheduler.num_stalls >= 1  # the case was reached
    for i, (_, _, max_tokens, _) in enumerate(plan):
        assert tokens[i] == greedy_generate(model, [prompts[i]], max_new_tokens=max_tokens,
                                            page_size=16)[0], i
    assert_no_leak(engine)


def test_look_ahead_protection_ends_with_the_queue(model):
    """Without tiers, the waiting requests' pages are evicted last (look-ahead); once the
    queue emptied, the last protection stayed until something queued again."""
    vocab = model.config.vocab_size
    engine = make_engine(model, max_num_seqs=1)
    a, b = random_prompt(64, vocab, seed=90), random_prompt(64, vocab, seed=91)
    engine.generate(b, GREEDY)  # b's pages cached
    _run(engine, [("a", a, 4, 0), ("b", b, 4, 0)])  # b waits behind a: protected
    nodes = engine.store.tree.walk(encode_tokens(b[:-1]), None)
    assert nodes
    engine.step()
    assert not any(engine.store.policy.is_protected(n) for n in nodes)
    assert_no_leak(engine)


def test_out_of_pages_a_younger_request_of_the_same_priority_gives_way(model):
    """The younger request needs a page first: it gives way (it preempted the older one, of
    the same priority); both outputs are the greedy ones."""
    vocab = model.config.vocab_size
    old, young = random_prompt(40, vocab, seed=60), random_prompt(30, vocab, seed=61)
    engine = make_engine(model, max_num_seqs=2, num_kv_pages=5)
    _, done, tokens = _run(engine, [("old", old, 12, 0), ("young", young, 12, 0)])
    assert engine.scheduler.num_preemptions >= 1
    assert done == ["old", "young"]
    want = greedy_generate(model, [old, young], max_new_tokens=12, page_size=16)
    assert tokens["old"] == want[0] and tokens["young"] == want[1]
    assert_no_leak(engine)
