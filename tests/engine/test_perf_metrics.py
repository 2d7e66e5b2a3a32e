"""Per-request performance metrics (`Request.return_perf_metrics`, TensorRT-LLM's
`return_perf_metrics`): wall-clock times of arrival, first scheduling, first and last token;
KV pages reused from the store, allocated new, and allocated to receive cached data (lower
tiers, beam copies); speculative drafts verified and accepted. Each is checked against what
the request did: page arithmetic of its prompt and output, the engine's own counters."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from engine_helpers import GREEDY, PAGE, assert_no_leak, make_engine, random_prompt

from backend.cache.tier_config import TierConfig
from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request, RequestMetrics
from backend.model import load_model

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repo/hybrid_llm/1/tiny_qwen3_5"


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL_DIR)


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def _timed(engine: Engine, prompt, params=GREEDY, **kw):
    t0 = time.time_ns()
    out = engine.generate(prompt, params, return_perf_metrics=True, **kw)
    return out, t0, time.time_ns()


def _check_times(m: RequestMetrics, t0: int, t1: int) -> None:
    # The wall clock of the metrics and the test's may differ by the clock's rounding.
    slack = 2_000_000
    assert t0 - slack <= m.arrival_time_ns <= m.first_scheduled_time_ns \
        <= m.first_token_time_ns <= m.last_token_time_ns <= t1 + slack


def test_a_miss_then_a_hit(model):
    engine = make_engine(model)
    prompt = random_prompt(90, model.config.vocab_size, seed=1)
    cold, t0, t1 = _timed(engine, prompt)
    m = cold.metrics
    _check_times(m, t0, t1)
    assert len(cold.new_token_ids) == GREEDY.max_tokens  # no end id met: 101 tokens computed
    computed = len(prompt) + len(cold.new_token_ids) - 1
    assert m.kv_cache_reused_blocks == 0
    assert m.kv_cache_alloc_new_blocks == m.kv_cache_alloc_total_blocks == _pages(computed)
    assert (m.total_draft_tokens, m.total_accepted_draft_tokens, m.acceptance_rate) == (0, 0, 0.0)

    warm, t0, t1 = _timed(engine, prompt)
    m = warm.metrics
    _check_times(m, t0, t1)
    assert warm.new_token_ids == cold.new_token_ids
    assert m.kv_cache_reused_blocks == warm.cached_tokens // PAGE == (len(prompt) - 1) // PAGE
    assert m.kv_cache_alloc_new_blocks == m.kv_cache_alloc_total_blocks \
        == _pages(computed) - m.kv_cache_reused_blocks
    assert engine.generate(prompt, GREEDY).metrics is None  # only when asked
    assert_no_leak(engine)


def test_every_streamed_output_carries_the_metrics_so_far(model):
    engine = make_engine(model)
    prompt = random_prompt(40, model.config.vocab_size, seed=2)
    outs = []
    engine.submit(Request("streamed", prompt, GREEDY, on_output=outs.append,
                          return_perf_metrics=True))
    while engine.has_work:
        engine.step()
    assert len(outs) == GREEDY.max_tokens
    firsts = {o.metrics.first_token_time_ns for o in outs}
    lasts = [o.metrics.last_token_time_ns for o in outs]
    assert len(firsts) == 1 and lasts == sorted(lasts) and lasts[0] == firsts.pop()
    assert lasts[-1] > lasts[0]
    news = [o.metrics.kv_cache_alloc_new_blocks for o in outs]
    assert news == sorted(news) and news[-1] == _pages(len(prompt) + GREEDY.max_tokens - 1)
    assert_no_leak(engine)


def test_times_follow_a_system_clock_stepped_after_start(model, monkeypatch):
    """A system clock stepped (NTP) after the engine started: the times are still the wall
    clock's at the request (CI once saw them 2.7 s behind with one offset per process)."""
    engine = make_engine(model)
    prompt = random_prompt(40, model.config.vocab_size, seed=3)
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 5_000_000_000)
    out, t0, t1 = _timed(engine, prompt)
    _check_times(out.metrics, t0, t1)


def test_pages_loaded_back_from_dram_count_in_the_total(model):
    base = make_engine(model, num_kv_pages=24, max_tokens_per_step=200)
    engine = Engine(model, replace(base.config, tiers=TierConfig(host_pages=64)))
    vocab = model.config.vocab_size
    prompts = [random_prompt(200, vocab, seed=s) for s in range(4)]
    for p in prompts:  # the first prompt's pages go down to DRAM
        engine.generate(p, GREEDY)
    host0 = engine.stats()["cache"]["hit_tokens_by_tier"]["host"]
    out, t0, t1 = _timed(engine, prompts[0][:150] + prompts[1][:30])
    m = out.metrics
    _check_times(m, t0, t1)
    loaded = (engine.stats()["cache"]["hit_tokens_by_tier"]["host"] - host0) // PAGE
    assert loaded > 0 and m.kv_cache_reused_blocks == out.cached_tokens // PAGE >= loaded
    assert m.kv_cache_alloc_total_blocks - m.kv_cache_alloc_new_blocks == loaded
    assert m.kv_cache_alloc_new_blocks == _pages(180 + GREEDY.max_tokens - 1) \
        - m.kv_cache_reused_blocks
    assert_no_leak(engine)
    engine.stop()


def test_speculative_drafts_are_counted(model):
    engine = Engine(model, EngineConfig(speculative_method="ngram", num_speculative_tokens=4,
                                        prompt_lookup_min=2, prompt_lookup_max=6,
                                        speculative_adaptive=False))
    prompt = random_prompt(12, model.config.vocab_size, seed=3) * 4  # drafts to look up
    s0 = engine.stats()
    out, t0, t1 = _timed(engine, prompt, SamplingParams(max_tokens=40, top_k=1))
    s1 = engine.stats()
    m = out.metrics
    _check_times(m, t0, t1)
    assert m.total_draft_tokens == s1["spec_draft_tokens"] - s0["spec_draft_tokens"] > 0
    assert m.total_accepted_draft_tokens == \
        s1["spec_accepted_tokens"] - s0["spec_accepted_tokens"]
    assert m.acceptance_rate == pytest.approx(m.total_accepted_draft_tokens
                                              / m.total_draft_tokens)
    assert_no_leak(engine)


def test_a_beam_search_counts_its_beams_pages(model):
    engine = make_engine(model)
    prompt = random_prompt(50, model.config.vocab_size, seed=4)
    s0 = engine.stats()
    params = SamplingParams(max_tokens=24, beam_width=3, end_id=-1)
    out, t0, t1 = _timed(engine, prompt, params)
    s1 = engine.stats()
    m = out.metrics
    _check_times(m, t0, t1)
    copied = s1["beam_pages_copied"] - s0["beam_pages_copied"]
    assert copied > 0 and m.kv_cache_alloc_total_blocks - m.kv_cache_alloc_new_blocks == copied
    # At least the prompt's and the best beam's pages; beams allocate more (forks' pages).
    assert m.kv_cache_alloc_new_blocks > _pages(len(prompt) + 23)
    assert_no_leak(engine)
