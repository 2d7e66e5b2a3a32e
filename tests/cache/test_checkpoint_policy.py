"""Where a hit may resume: checkpoint baseline (checkpoints and prompt ends only),
suffixreplay (any page boundary), none (never)."""

from __future__ import annotations

import random

import pytest
from cache_helpers import cache_tokens, make_store

from backend.cache import CacheConfig, PrefixStore, checkpoint_positions
from backend.cache.checkpoint import sglang_positions

PROMPT_LEN = 1000
_rng = random.Random(0)
PROMPT = [_rng.randrange(1000) for _ in range(PROMPT_LEN)]


def _store(policy: str) -> PrefixStore:
    return PrefixStore(
        CacheConfig(
            page_size=64,
            policy=policy,
            checkpoint_interval=256,
            num_kv_pages=64,
            num_checkpoint_slots=8,
        )
    )


@pytest.mark.parametrize(
    "prompt_len, start, expected",
    [
        (1000, 0, [256, 512, 768, 960]),
        (1024, 0, [256, 512, 768, 1024]),
        (1000, 512, [768, 960]),
        (1000, 500, [512, 768, 960]),
        (1000, 960, []),
        (100, 0, [64]),
        (63, 0, []),
    ],
)
def test_checkpoint_positions(prompt_len, start, expected):
    assert checkpoint_positions(prompt_len, start, interval=256, page_size=64) == expected


@pytest.mark.parametrize(
    "kwargs", [dict(interval=100, page_size=64), dict(interval=256, page_size=64, start=2000)]
)
def test_checkpoint_positions_rejects_bad_arguments(kwargs):
    args = dict(prompt_len=1000, start=0) | kwargs
    with pytest.raises(ValueError):
        checkpoint_positions(**args)


@pytest.mark.parametrize(
    "prompt_len, start, branch, expected",
    [
        (1000, 0, None, [960]),            # one chunk: its last whole page
        (1000, 0, 320, [320]),             # the branch point instead
        (1000, 320, 320, [960]),           # resumed at the branch point: not inside
        (20_000, 0, None, [8192, 16384, 19968]),  # one per SGLang prefill chunk
        (20_000, 0, 10_048, [8192, 10_048, 19968]),
        (20_000, 64, None, [8256, 16448, 19968]),  # chunks count from the resume point
        (1000, 960, None, []),             # less than a page left
        (8192, 0, 8192, [8192]),           # at the end: not strictly inside
    ],
)
def test_sglang_positions(prompt_len, start, branch, expected):
    assert sglang_positions(prompt_len, start, chunk=8192, page_size=64,
                            branch_point=branch) == expected


@pytest.mark.parametrize("kwargs", [dict(chunk=100), dict(chunk=8192, start=2000)])
def test_sglang_positions_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        sglang_positions(**(dict(prompt_len=1000, start=0, page_size=64) | kwargs))


def test_placement_is_validated():
    with pytest.raises(ValueError, match="checkpoint_placement"):
        CacheConfig(checkpoint_placement="dense")
    with pytest.raises(ValueError, match="checkpoint_prefill_chunk"):
        CacheConfig(checkpoint_prefill_chunk=100)
    store = PrefixStore(CacheConfig(page_size=64, policy="checkpoint", num_kv_pages=64,
                                    checkpoint_placement="sglang"))
    assert store.checkpoint_positions(20_000) == [8192, 16384, 19968]
    assert store.checkpoint_positions(1000, 0, branch_point=320) == [320]


def test_only_the_checkpoint_policy_asks_for_checkpoints():
    assert _store("checkpoint").checkpoint_positions(1000) == [256, 512, 768, 960]
    assert _store("suffixreplay").checkpoint_positions(1000) == []
    assert _store("none").checkpoint_positions(1000) == []


def _resume_points(policy: str) -> dict[int, int]:
    """Cut -> matched tokens, for a branch off PROMPT at every page boundary."""
    store = _store(policy)
    cache_tokens(store, PROMPT)
    store.assert_invariants()
    resumes = {}
    for cut in range(64, PROMPT_LEN + 1, 64):
        branch = PROMPT[:cut] + [-1] * 100  # diverges right after the cut
        resumes[cut] = store.match_prefix(branch).num_matched_tokens
    return resumes


def test_checkpoint_policy_resumes_only_at_checkpoints_and_the_prompt_end():
    resumes = _resume_points("checkpoint")
    for cut, matched in resumes.items():
        assert matched == max(p for p in (0, 256, 512, 768, 960) if p <= cut), cut
    assert set(resumes.values()) == {0, 256, 512, 768, 960}


def test_suffixreplay_resumes_at_every_page_boundary():
    assert all(matched == cut for cut, matched in _resume_points("suffixreplay").items())


def test_none_never_hits():
    assert set(_resume_points("none").values()) == {0}


def test_a_checkpoint_can_go_while_its_kv_pages_stay():
    store = _store("checkpoint")
    cache_tokens(store, PROMPT)
    store.match_prefix(PROMPT[:600])  # refreshes the checkpoint at 512 only
    assert store.evict_checkpoints(1) == 1  # the least recently used one: 256
    match = store.match_prefix(PROMPT[:300])
    assert match.num_matched_tokens == 0 and match.num_cached_pages == 4
    assert store.match_prefix(PROMPT[:600]).num_matched_tokens == 512
    assert store.stats.checkpoint_evictions_by_reason["explicit"] == 1
    store.assert_invariants()


def test_match_reports_the_checkpoint_to_resume_from():
    store = _store("checkpoint")
    cache_tokens(store, PROMPT)
    match = store.match_prefix(PROMPT[:700])
    assert match.checkpoint.num_tokens == 512 and match.checkpoint.node is match.nodes[-1]
    assert match.live_state == match.checkpoint.slot
    assert len(match.kv_pages) == 8


def test_checkpoint_slots_are_recycled_lru_also_from_locked_paths():
    store = make_store(policy="checkpoint", num_checkpoint_slots=2, num_kv_pages=16)
    a = cache_tokens(store, [1] * 8)  # one checkpoint, at 8 (interval and prompt end)
    b = cache_tokens(store, [2] * 8)
    c = cache_tokens(store, [3] * 8)  # the pool is full: a's checkpoint (LRU) goes
    assert a.nodes[-1].state_slot is None
    assert None not in (b.nodes[-1].state_slot, c.nodes[-1].state_slot)
    assert store.match_prefix([1] * 8).num_matched_tokens == 0  # KV stays, no resume point
    # A lock keeps a running request's KV; a checkpoint is read only at admission, so the
    # LRU one goes even on a locked path (a request holding a long matched path must not
    # pin every slot), and its KV page stays.
    store.lock(b.nodes)
    store.lock(c.nodes)
    held = store.alloc_state_slots(1)
    assert held is not None and b.nodes[-1].state_slot is None
    assert b.nodes[-1].kv_page is not None and c.nodes[-1].state_slot is not None
    held += store.alloc_state_slots(1)
    assert c.nodes[-1].state_slot is None
    assert store.alloc_state_slots(1) is None  # every slot is held by a caller now
    store.free_state_slots(held)
    store.unlock(b.nodes)
    store.unlock(c.nodes)
    store.assert_invariants()


def test_evicting_a_page_drops_its_checkpoint():
    store = make_store(policy="checkpoint")
    cache_tokens(store, [1] * 8)
    assert store.evict(1) == 1
    assert store.stats.checkpoint_evictions_by_reason["with_page"] == 1
    assert store.state_pool.num_used == 0
    store.assert_invariants()


def test_suffixreplay_live_state_only_at_exactly_its_prefix_end():
    store = make_store()
    tokens = list(range(12))
    alloc = store.alloc_pages(3)
    (slot,) = store.alloc_state_slots(1)
    store.insert(tokens, None, alloc.kv_pages, alloc.anchor_blocks, {12: slot})
    assert store.match_prefix(tokens + [99, 98]).live_state == slot  # continuation
    shorter = store.match_prefix(tokens[:8])
    assert shorter.live_state is None and shorter.checkpoint is None
    assert shorter.num_matched_tokens == 8  # replay resumes there anyway
    store.assert_invariants()


def test_lookahead_protects_checkpoints_too():
    store = make_store(policy="checkpoint", lookahead_window=1)
    cache_tokens(store, [1] * 8)
    cache_tokens(store, [2] * 8)  # newer checkpoint
    store.protect([([1] * 8 + [5] * 4, None)])  # the next request resumes from [1] * 8
    assert store.evict_checkpoints(1) == 1
    assert store.match_prefix([1] * 8).num_matched_tokens == 8
    assert store.match_prefix([2] * 8).num_matched_tokens == 0
    assert store.stats.protected_pages_passed_over == 1
