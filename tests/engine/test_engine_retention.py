"""Retention priorities through the engine: a request's `retention` (TensorRT-LLM's
KvCacheRetentionConfig) keeps an agent's system prompt cached through a flood of other
prompts that a plain LRU lets push it out, and so does a session_id (the engine's
session_priority); outputs stay those of a cold engine."""

from __future__ import annotations

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
