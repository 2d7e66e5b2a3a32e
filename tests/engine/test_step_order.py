"""A step's outputs go to their clients before its cache work (`Scheduler.after_outputs`):
a first token never waits for the store, and by the time another thread can look, a
finished request holds nothing."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import PAGE, assert_no_leak, make_engine, random_prompt
from hf_oracle import make_hf_checkpoint

from backend.engine import SamplingParams
from backend.engine.request import Request
from backend.model import load_model

SAMPLING = SamplingParams(max_tokens=4, min_tokens=4, top_k=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("step-order-model")
    make_hf_checkpoint(path, seed=5)
    return load_model(path)


def _run(engine, rid, prompt, on_output) -> threading.Event:
    done = threading.Event()

    def collect(out):
        on_output(out)
        if out.finished:
            done.set()

    engine.submit(Request(rid, prompt, SAMPLING, on_output=collect))
    return done


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_the_first_token_goes_out_before_the_prompt_joins_the_store(model, policy):
    engine = make_engine(model, policy=policy, max_tokens_per_step=256)
    prompt = random_prompt(6 * PAGE, model.config.vocab_size, seed=1)  # one prefill step
    seen: list[tuple[int, int]] = []

    def on_output(out):
        if out.new_token_ids and not seen:
            # stats() from an output callback (the engine thread, inside its step)
            seen.append((engine.store.num_cached_pages, engine.stats()["cached_pages"]))

    engine.start()
    try:
        assert _run(engine, "a", prompt, on_output).wait(60), "the request never finished"
        assert seen == [(0, 0)]  # delivered before the insert
        assert engine.stats()["cached_pages"] == 6  # and inserted after it
        hit: list = []
        assert _run(engine, "b", prompt, hit.append).wait(60)
        assert hit[-1].cached_tokens >= 4 * PAGE  # a hit: up to the last saved state
    finally:
        engine.stop()
    assert_no_leak(engine)


def test_a_finished_request_holds_nothing_when_another_thread_sees_its_last_output(model):
    engine = make_engine(model)
    vocab = model.config.vocab_size
    engine.start()
    try:
        for i in range(6):
            done = _run(engine, f"r{i}", random_prompt(3 * PAGE + i, vocab, seed=10 + i),
                        lambda out: None)
            assert done.wait(60)
            stats = engine.stats()
            assert stats["active_requests"] == 0
            assert stats["kv_pages_held_by_requests"] == 0
    finally:
        engine.stop()
    assert_no_leak(engine)


def test_cache_work_that_fails_fails_its_requests_and_leaks_nothing(model, monkeypatch):
    engine = make_engine(model, max_tokens_per_step=256)
    vocab = model.config.vocab_size
    insert = engine.cache.insert
    calls = {"n": 0}

    def failing_insert(seq, num_tokens, with_states=True):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected insert failure")
        return insert(seq, num_tokens, with_states)

    monkeypatch.setattr(engine.cache, "insert", failing_insert)
    outputs: list = []
    done = _run(engine, "a", random_prompt(4 * PAGE, vocab, seed=2), outputs.append)
    while engine.has_work:
        engine.step()
    assert done.is_set()
    assert outputs[0].new_token_ids and not outputs[0].finished  # the first token went out
    assert outputs[-1].finish_reason == "error"
    assert "injected insert failure" in outputs[-1].error
    assert engine.stats()["failed_requests"] == 1
    assert_no_leak(engine)
    # The engine goes on: the next request runs to its end and its prompt is cached.
    out = engine.generate(random_prompt(4 * PAGE, vocab, seed=3), SAMPLING)
    assert out.finish_reason == "length" and len(out.new_token_ids) == 4
    assert engine.stats()["cached_pages"] == 4
    assert_no_leak(engine)


@pytest.mark.parametrize("where", ["admit_load_state", "after_forward", "keep_replayed"])
def test_a_failed_state_copy_leaks_no_lock_and_no_slot(model, monkeypatch, where):
    """A state load failing during admission left the matched path locked for good (its
    pages could never be evicted); a state save failing after a forward or a replay left
    the slot it was filling held."""
    from backend.replay.budget import ReplayConfig

    policy = "checkpoint" if where == "admit_load_state" else "suffixreplay"
    engine = make_engine(model, policy=policy, interval=32, num_checkpoint_slots=8,
                         replay=ReplayConfig.exact())
    prompt = random_prompt(64 if policy == "checkpoint" else 40,
                           model.config.vocab_size, seed=4)
    if where != "after_forward":  # (after_forward: a fresh prompt saves its states)
        engine.generate(prompt, SAMPLING)
    if where == "keep_replayed":  # the pages stay, their states go: the next one replays
        engine.store.evict_checkpoints(100)
    name = "load_state" if where == "admit_load_state" else "save_state"

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected {name} failure")

    monkeypatch.setattr(engine.executor, name, boom)
    out = engine.generate(prompt + [3, 4], SAMPLING)
    monkeypatch.undo()
    assert out.finish_reason == "error" and f"injected {name} failure" in out.error
    assert_no_leak(engine)
    assert engine.reset_prefix_cache()["kept_pages"] == 0
