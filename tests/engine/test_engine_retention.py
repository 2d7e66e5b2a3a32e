"""Retention priorities through the engine: a request's `retention` (TensorRT-LLM's
KvCacheRetentionConfig) keeps an agent's system prompt cached through a flood of other
prompts that a plain LRU lets push it out, and so does a session_id (the engine's
session_priority); outputs stay those of a cold engine."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
from engine_helpers import GREEDY, TINY_MODEL_DIR, assert_no_leak, make_engine, random_prompt

from backend.cache.retention import RetentionConfig, RetentionRange
from backend.engine import Engine, Request
from backend.model import load_model

SYSTEM = 64  # tokens: 4 pages of 16


@pytest.fixture(scope="module")
def model():
    return load_model(TINY_MODEL_DIR)


def _agent_then_flood(model, retention: RetentionConfig | None):
    vocab = model.config.vocab_size
    engine = make_engine(model, num_kv_pages=24)
    system = random_prompt(SYSTEM, vocab, seed=10)
    first = engine.generate(system + random_prompt(30, vocab, seed=11), GREEDY,
                            retention=retention)
    for seed in range(20, 24):  # 4 prompts of 7 pages each through a pool of 24
        engine.generate(random_prompt(100, vocab, seed=seed), GREEDY)
    call = system + random_prompt(30, vocab, seed=12)
    again = engine.generate(call, GREEDY)
    assert_no_leak(engine)
    cold = make_engine(model, num_kv_pages=24).generate(call, GREEDY)
    assert again.new_token_ids == cold.new_token_ids
    return first, again


def test_a_retained_system_prompt_survives_a_flood(model):
    keep = RetentionConfig(ranges=(RetentionRange(0, SYSTEM, 100),))
    _, lru = _agent_then_flood(model, None)
    assert lru.cached_tokens == 0  # the plain LRU evicted it
    _, kept = _agent_then_flood(model, keep)
    assert kept.cached_tokens == SYSTEM


def test_a_zero_priority_prompt_goes_before_older_default_ones(model):
    vocab = model.config.vocab_size
    engine = make_engine(model, num_kv_pages=24)
    old = random_prompt(40, vocab, seed=30)
    engine.generate(old, GREEDY)
    once = random_prompt(40, vocab, seed=31)
    engine.generate(once, GREEDY, retention=RetentionConfig(
        ranges=(RetentionRange(0, None, 0),), decode_priority=0))
    # 21 pages of 24: the 3 of one of the two earlier prompts must go (6 are cached).
    engine.generate(random_prompt(320, vocab, seed=32), GREEDY)
    assert engine.generate(old, GREEDY).cached_tokens > 0
    assert engine.generate(once, GREEDY).cached_tokens == 0
    assert_no_leak(engine)


def test_a_bad_retention_is_refused(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match="RetentionConfig"):
        engine.submit(Request("bad", [1, 2, 3], GREEDY, retention={"priority": 100}))
    assert_no_leak(engine)


@pytest.mark.parametrize("session_priority, kept", [(50, True), (35, False)])
def test_a_sessions_pages_outlive_one_off_prompts(model, session_priority, kept):
    """A request with a session_id leaves its pages at `session_priority` (50 by default):
    its conversation is still cached after the flood; at 35 it is a plain LRU's victim."""
    vocab = model.config.vocab_size
    base = make_engine(model, num_kv_pages=24)
    engine = Engine(model, replace(base.config, session_priority=session_priority))
    history = random_prompt(SYSTEM, vocab, seed=40)
    engine.generate(history, GREEDY, session_id="chat-1")
    for seed in range(41, 45):
        engine.generate(random_prompt(100, vocab, seed=seed), GREEDY)
    turn = engine.generate(history + random_prompt(20, vocab, seed=46), GREEDY,
                           session_id="chat-1")
    assert turn.cached_tokens == (SYSTEM if kept else 0)
    assert_no_leak(engine)


def test_session_settings_are_checked():
    from backend.engine import EngineConfig

    assert EngineConfig.from_params({"session_priority": "90", "session_retention_s": "2.5"}) \
        .session_retention_s == 2.5
    with pytest.raises(ValueError, match=r"session_priority must be an integer in \[0, 100\]"):
        EngineConfig(session_priority=101)
    with pytest.raises(ValueError, match="session_retention_s must be >= 0 seconds"):
        EngineConfig(session_retention_s=-1.0)


def _two_requests(engine, vocab, retention):
    """A long request and a short one with `retention`, submitted together and stepped to
    their ends (the short one finishes, and is released, while the long one runs)."""
    from backend.engine import SamplingParams

    outs = {}

    def keep(out):
        if out.finished:
            outs[out.request_id] = out

    engine.submit(Request("long", random_prompt(120, vocab, seed=50),
                          SamplingParams(max_tokens=20, top_k=1), on_output=keep))
    engine.submit(Request("short", random_prompt(120, vocab, seed=51),
                          SamplingParams(max_tokens=2, top_k=1), on_output=keep,
                          retention=retention))
    for _ in range(200):
        if not engine.has_work:
            break
        engine.step()
    return outs


def test_retention_with_the_ssd_directory_gone_serves_on(model, tmp_path):
    """The SSD directory removed under a running engine: a request with a retention priority
    finishes and is released as any other (its priority cannot be logged for a restart),
    the request running beside it goes on, nothing leaks. (Before, the log's OSError escaped
    the release, and the failed step's cleanup freed the same pages again, which killed the
    engine's step.)"""
    from backend.cache.tier_config import TierConfig

    vocab = model.config.vocab_size
    base = make_engine(model, num_kv_pages=32, max_tokens_per_step=128)
    engine = Engine(model, replace(base.config, tiers=TierConfig(
        host_pages=8, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m", ssd_bytes=1 << 30)))
    engine.generate(random_prompt(100, vocab, seed=1), GREEDY)
    engine.tiers.drain()
    shutil.rmtree(tmp_path / "ssd")
    outs = _two_requests(engine, vocab, RetentionConfig(ranges=(RetentionRange(0, None, 90),)))
    assert {rid: o.finish_reason for rid, o in outs.items()} == {"long": "length",
                                                                  "short": "length"}
    assert engine.num_failed == 0
    assert engine.tiers.retention_log.write_errors > 0
    engine.tiers.drain()
    assert_no_leak(engine)
    engine.stop()


def test_a_release_that_fails_partway_never_frees_twice(model, monkeypatch):
    """Cache work that raises after a request's final output (here: setting its pages'
    retention) fails the step: the requests still running end with an error, as a failed
    step's do; the finished one's pages are freed once, nothing leaks, and the engine serves
    the next request."""
    vocab = model.config.vocab_size
    engine = make_engine(model, num_kv_pages=32, max_tokens_per_step=128)
    real = engine.store.retain
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.store, "retain", fails_once)
    outs = _two_requests(engine, vocab, RetentionConfig(ranges=(RetentionRange(0, None, 90),)))
    assert outs["short"].finish_reason == "length"
    assert outs["long"].finish_reason == "error" and "injected" in outs["long"].error
    assert_no_leak(engine)
    after = engine.generate(random_prompt(60, vocab, seed=52), GREEDY)
    assert after.finish_reason == "length"
    assert_no_leak(engine)
