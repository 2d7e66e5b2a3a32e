"""`Engine.reset_prefix_cache`: the cached prefixes go from every tier (device, DRAM, SSD,
and what an earlier run left on SSD), or from one cache_salt namespace; pages a running
request holds stay and that request's tokens do not change; nothing leaks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_helpers import GREEDY, assert_no_leak, make_engine, random_prompt

from backend.cache.retention_log import FILE_NAME as LOG_NAME
from backend.cache.tier_config import TierConfig
from backend.engine import Engine, SamplingParams
from backend.engine.request import Request
from backend.model import load_model
from backend.model.generate import greedy_generate


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine_helpers import family_checkpoint

    path = tmp_path_factory.mktemp("reset-qwen3_5")
    family_checkpoint(path, "qwen3_5", seed=3)
    return load_model(path)


def _greedy(model, prompt, n=12):
    return greedy_generate(model, [prompt], max_new_tokens=n, page_size=16)[0]


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_reset_forgets_every_prefix(model, policy):
    engine = make_engine(model, policy=policy, max_tokens_per_step=200)
    prompt = random_prompt(150, 97, seed=1)
    first = engine.generate(prompt, GREEDY)
    assert engine.generate(prompt, GREEDY).cached_tokens > 0
    cached = engine.stats()["cached_pages"]
    assert engine.reset_prefix_cache() == {"dropped_pages": cached, "kept_pages": 0}
    stats = engine.stats()
    assert stats["cached_pages"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["state_slots_free"] == stats["state_slots_total"]
    assert stats["prefix_cache_resets"] == 1
    assert stats["cache"]["page_evictions_by_reason"]["reset"] == cached
    again = engine.generate(prompt, GREEDY)
    assert again.cached_tokens == 0 and again.new_token_ids == first.new_token_ids
    assert_no_leak(engine)


def test_reset_of_one_namespace(model):
    engine = make_engine(model, max_tokens_per_step=200)
    a, b = random_prompt(150, 97, seed=2), random_prompt(150, 97, seed=3)
    engine.generate(a, GREEDY, cache_salt="tenant-a")
    engine.generate(b, GREEDY, cache_salt="tenant-b")
    engine.generate(a, GREEDY)  # the default namespace
    result = engine.reset_prefix_cache("tenant-a", every_salt=False)
    assert result["dropped_pages"] > 0 and result["kept_pages"] == 0
    assert engine.generate(a, GREEDY, cache_salt="tenant-a").cached_tokens == 0
    assert engine.generate(b, GREEDY, cache_salt="tenant-b").cached_tokens > 0
    assert engine.generate(a, GREEDY).cached_tokens > 0
    # A namespace nothing was cached in: nothing to drop.
    assert engine.reset_prefix_cache("nobody", every_salt=False) == \
        {"dropped_pages": 0, "kept_pages": 0}
    assert_no_leak(engine)


def test_reset_keeps_what_running_requests_hold(model):
    """A request whose prompt pages are in the tree, locked, decodes on through a reset:
    its pages stay (counted as kept), its tokens equal a full prefill's, the pages of the
    finished request before it are gone; afterwards the store is whole."""
    engine = make_engine(model, max_tokens_per_step=200)
    done = random_prompt(150, 97, seed=4)
    engine.generate(done, GREEDY)
    prompt = random_prompt(140, 97, seed=5)
    params = SamplingParams(max_tokens=30, top_k=1)
    tokens: list[int] = []
    finished = []

    def collect(out):
        tokens.extend(out.new_token_ids)
        if out.finished:
            finished.append(out)
    engine.submit(Request("running", prompt, params, on_output=collect))
    while len(tokens) < 3:
        engine.step()
    result = engine.reset_prefix_cache()
    assert result["kept_pages"] == 140 // 16 and result["dropped_pages"] > 0
    engine.store.assert_invariants()
    while engine.has_work:
        engine.step()
    assert finished and tokens == _greedy(model, prompt, 30)
    assert engine.generate(done, GREEDY).cached_tokens == 0
    assert engine.generate(prompt, GREEDY).cached_tokens == 128  # kept, and cached again
    assert_no_leak(engine)


def _tiered(model, tmp_path, policy="suffixreplay") -> Engine:
    slots = dict(host_checkpoint_slots=2, ssd_checkpoint_slots=16) if policy == "checkpoint" \
        else {}
    tiers = TierConfig(host_pages=12, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m",
                       ssd_bytes=1 << 30, **slots)
    base = make_engine(model, policy=policy, num_kv_pages=24, max_tokens_per_step=200,
                       num_checkpoint_slots=3)
    return Engine(model, replace(base.config, tiers=tiers))


def _ssd_files(tmp_path) -> list:
    """The pages' and states' files (not the retention log beside them)."""
    return [p for p in (tmp_path / "ssd").rglob("*") if p.is_file() and p.name != LOG_NAME]


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_reset_empties_dram_and_ssd(model, tmp_path, policy):
    engine = _tiered(model, tmp_path, policy)
    prompts = [random_prompt(200, 97, seed=s) for s in range(10, 14)]
    for p in prompts:
        engine.generate(p, GREEDY)
    engine.tiers.drain()
    stats = engine.stats()
    assert stats["cache"]["pages_demoted"] > 0 and _ssd_files(tmp_path)
    engine.reset_prefix_cache()
    engine.tiers.drain()
    memory = engine.stats()["memory_bytes"]
    assert memory["host"] == 0 and memory["ssd"] == 0, memory
    assert not _ssd_files(tmp_path)
    got = engine.generate(prompts[0], GREEDY)
    assert got.cached_tokens == 0 and got.new_token_ids == _greedy(model, prompts[0])
    engine.tiers.drain()
    assert_no_leak(engine)
    engine.tiers.assert_invariants()
    engine.stop()


def test_reset_deletes_what_an_earlier_run_left_on_ssd(model, tmp_path):
    """A restarted engine restores a namespace's SSD pages when a request first names it;
    a reset before that deletes them (and the checkpoint states' files): the request
    misses."""
    engine = _tiered(model, tmp_path, "checkpoint")
    prompts = [random_prompt(200, 97, seed=s) for s in range(20, 24)]
    for p in prompts:
        engine.generate(p, GREEDY)
    engine.tiers.drain()
    engine.stop()
    assert _ssd_files(tmp_path)
    restarted = _tiered(model, tmp_path, "checkpoint")
    assert restarted.reset_prefix_cache() == {"dropped_pages": 0, "kept_pages": 0}
    restarted.tiers.drain()
    assert not _ssd_files(tmp_path)
    got = restarted.generate(prompts[0], GREEDY)
    assert got.cached_tokens == 0 and got.new_token_ids == _greedy(model, prompts[0])
    restarted.tiers.drain()
    assert restarted.stats()["tiers"]["restored_pages"] == 0
    assert_no_leak(restarted)
    restarted.tiers.assert_invariants()
    restarted.stop()


def test_a_restarted_engine_keeps_the_retention_priorities_of_its_ssd_pages(model, tmp_path):
    """A system prompt sent at retention priority 100 comes back from SSD at 100 after a
    restart (pages it did not cover at the default), so a flood does not push it out."""
    from backend.cache.retention import DEFAULT_PRIORITY, RetentionConfig, RetentionRange

    engine = _tiered(model, tmp_path)
    system = random_prompt(64, 97, seed=40)
    keep = RetentionConfig(ranges=(RetentionRange(0, 64, 100),))
    engine.generate(system + random_prompt(40, 97, seed=41), GREEDY, retention=keep)
    engine.tiers.drain()
    engine.stop()
    restarted = _tiered(model, tmp_path)
    nodes = restarted.store.match_prefix(system + random_prompt(40, 97, seed=41)).nodes
    assert [n.priority for n in nodes] == [100] * 4 + [DEFAULT_PRIORITY] * (len(nodes) - 4)
    assert restarted.stats()["tiers"]["restored_priorities"] == 4
    got = restarted.generate(system + random_prompt(30, 97, seed=42), GREEDY)
    assert got.cached_tokens == 64
    restarted.tiers.drain()
    assert_no_leak(restarted)
    restarted.tiers.assert_invariants()
    restarted.stop()
