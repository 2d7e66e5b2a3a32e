"""Retention priorities (TensorRT-LLM's KvCacheRetentionConfig): which pages a request's
config gives which priority, and how the store's eviction follows them on the device
(lowest priority first, LRU within), with durations, the look-ahead window and checkpoints."""

from __future__ import annotations

import pytest
from cache_helpers import cache_tokens, make_store, pages

from backend.cache import CacheConfig, PrefixStore
from backend.cache.retention import (
    DEFAULT_PRIORITY,
    DEFAULT_RETENTION,
    RetentionConfig,
    RetentionRange,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _four_leaves(window: int = 0) -> tuple[PrefixStore, dict[str, list]]:
    """Four one-page prompts, oldest first: A, B, C, D (a plain LRU evicts them in order)."""
    store = make_store(num_kv_pages=8, lookahead_window=window)
    store.evictor.clock = FakeClock()
    paths = {name: cache_tokens(store, pages(i)).nodes for i, name in enumerate("ABCD", 1)}
    return store, paths


def _cached(store: PrefixStore) -> str:
    return "".join(name for i, name in enumerate("ABCD", 1)
                   if store.match_prefix(pages(i), count_hits=False).num_matched_pages)


# Page priorities of one request ----------------------------------------------------------
def test_ranges_map_onto_the_pages_they_overlap():
    config = RetentionConfig(
        ranges=(RetentionRange(0, 100, 90, 10.0), RetentionRange(60, 130, 50)),
        decode_priority=10, decode_duration_s=5.0)
    # 64-token pages, a 200-token prompt, 300 tokens in all: pages 0..4.
    assert config.page_priorities(5, 64, 200) == [
        (90, 10.0),   # [0, 64): the first range only
        (90, 10.0),   # [64, 128): both ranges, the higher wins
        (50, None),   # [128, 192): the second range ends at 130
        (10, 5.0),    # [192, 256): prompt tokens 192..199, no range; generated tokens
        (10, 5.0),    # [256, 300): generated only
    ]


def test_an_open_range_ends_with_the_prompt_and_equal_priorities_keep_the_longest():
    config = RetentionConfig(ranges=(RetentionRange(0, None, 70, 1.0),
                                     RetentionRange(0, 64, 70, None)))
    assert config.page_priorities(3, 64, 128) == [(70, None), (70, 1.0), (DEFAULT_PRIORITY,
                                                                          None)]
    assert DEFAULT_RETENTION.page_priorities(2, 64, 10) == [(DEFAULT_PRIORITY, None)] * 2


@pytest.mark.parametrize("make, message", [
    (lambda: RetentionRange(-1, 10, 50), "start"),
    (lambda: RetentionRange(10, 10, 50), "end"),
    (lambda: RetentionRange(0, None, 101), "priority"),
    (lambda: RetentionRange(0, None, -1), "priority"),
    (lambda: RetentionRange(0, None, 50, -2.0), "duration"),
    (lambda: RetentionRange(0, None, 50, float("nan")), "duration"),
    (lambda: RetentionConfig(decode_priority=200), "decode retention priority"),
    (lambda: RetentionConfig(decode_duration_s=float("inf")), "decode retention duration"),
    (lambda: RetentionRange(0, None, 50, 10 ** 400), "duration"),  # (was an OverflowError)
    (lambda: RetentionRange(0, None, 50, True), "duration"),  # (was 1 s)
    (lambda: RetentionRange(0, None, 50, "5"), "duration"),  # (was a TypeError)
    # (were accepted, and failed the step of every request in the batch at release)
    (lambda: RetentionConfig(ranges=[(0, None, 100)]), "ranges must be a sequence of"),
    (lambda: RetentionConfig(ranges=None), "ranges must be a sequence of"),
])
def test_bad_configs_are_refused_with_what_was_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# Device eviction order ---------------------------------------------------------------------
def test_a_high_priority_page_outlives_older_and_newer_default_ones():
    store, paths = _four_leaves()
    assert store.retain(paths["A"], [(100, None)]) == 1
    assert store.evict(2) == 2
    assert _cached(store) == "AD"  # B, C went: the oldest default pages
    assert store.evict(1) == 1 and _cached(store) == "A"
    assert store.stats.retained_page_evictions == 0
    assert store.evict(1) == 1 and _cached(store) == ""  # a priority, not a pin
    assert store.stats.retained_page_evictions == 1
    store.assert_invariants()


def test_a_low_priority_page_goes_first_even_when_most_recent():
    store, paths = _four_leaves()
    store.retain(paths["D"], [(0, None)])
    assert store.evict(1) == 1
    assert _cached(store) == "ABC"
    store.assert_invariants()


def test_a_priority_is_raised_never_lowered_by_another_request():
    store, paths = _four_leaves()
    store.retain(paths["A"], [(100, None)])
    assert store.retain(paths["A"], [(DEFAULT_PRIORITY, None)]) == 0  # a default request
    assert store.retain(paths["A"], [(20, 5.0)]) == 0
    assert paths["A"][0].priority == 100
    store.retain(paths["B"], [(0, None)])
    assert store.retain(paths["B"], [(DEFAULT_PRIORITY, None)]) == 1  # reused: default
    assert store.evict(1) == 1 and _cached(store) == "ACD"  # B is the oldest default page


def test_a_priority_reverts_to_the_default_when_its_duration_ends():
    store, paths = _four_leaves()
    clock = store.evictor.clock
    store.retain(paths["A"], [(100, 30.0)])
    store.retain(paths["D"], [(0, 30.0)])
    clock.now += 20
    store.retain(paths["A"], [(100, 5.0)])  # same priority, earlier end: the later stands
    assert store.evict(1) == 1 and _cached(store) == "ABC"  # D (priority 0) first
    clock.now += 10.5  # A's priority ended: it is the oldest default page again
    assert store.evictor.priority_of(paths["A"][0]) == DEFAULT_PRIORITY
    assert store.evict(1) == 1 and _cached(store) == "BC"
    store.assert_invariants()


def test_a_shorter_raise_gives_way_to_the_longer_grant_it_outdid():
    """A at 50 for 100 s, then B at 60 for 1 s: when B's ended the page fell to the default
    although A's 50 still ran; and C's 40 for ever (after both) holds once A's ended."""
    store, paths = _four_leaves()
    clock, node = store.evictor.clock, paths["A"][0]
    assert store.retain(paths["A"], [(50, 100.0)]) == 1
    assert store.retain(paths["A"], [(60, 1.0)]) == 1
    assert store.retain(paths["A"], [(40, None)]) == 0  # not a raise: kept for later
    assert store.retain(paths["A"], [(30, 50.0)]) == 0  # outdone by A's: dropped
    assert store.evictor.priority_of(node) == 60
    clock.now += 2
    assert store.evictor.priority_of(node) == 50
    store.evictor.expire()
    assert (node.priority, node.priority_later) == (50, [(40, None)])
    store.retain(paths["D"], [(45, None)])
    assert store.evict(3) == 3 and _cached(store) == "A"  # B, C (35), D (45) before A (50)
    clock.now += 100
    store.evictor.expire()
    assert (node.priority, node.priority_until, node.priority_later) == (40, None, [])
    store.assert_invariants()


def test_a_later_expiry_at_the_same_priority_extends_it():
    store, paths = _four_leaves()
    clock = store.evictor.clock
    store.retain(paths["A"], [(100, 10.0)])
    clock.now += 8
    assert store.retain(paths["A"], [(100, 10.0)]) == 1
    clock.now += 8  # 16 s after the first: the second's 10 s still run
    assert store.evict(1) == 1 and _cached(store) == "ACD"


def test_the_lookahead_window_still_goes_before_priorities():
    store, paths = _four_leaves(window=1)
    store.retain(paths["B"], [(100, None)])
    store.retain(paths["A"], [(0, None)])
    store.protect([(pages(1), None)])  # the next waiting request needs A
    assert store.evict(1) == 1 and _cached(store) == "ABD"  # C: oldest unprotected default
    assert store.evict(1) == 1 and _cached(store) == "AB"
    assert store.evict(1) == 1 and _cached(store) == "A"  # B (100) before the protected A
    store.assert_invariants()


def test_only_leaves_go_so_a_retained_prefix_keeps_its_children_behind_it():
    store = make_store(num_kv_pages=8, lookahead_window=0)
    system = cache_tokens(store, pages(1, 2)).nodes
    cache_tokens(store, pages(1, 2, 3))
    cache_tokens(store, pages(4))
    store.retain(system, [(100, None), (100, None)])
    assert store.evict(2) == 2  # [3] under the system prompt and [4]; the prompt stays
    assert store.match_prefix(pages(1, 2), count_hits=False).num_matched_pages == 2
    assert store.match_prefix(pages(4), count_hits=False).num_matched_pages == 0
    store.assert_invariants()


def test_checkpoints_follow_their_pages_priority():
    store = PrefixStore(CacheConfig(page_size=4, policy="checkpoint", checkpoint_interval=4,
                                    anchor_density=0.25,
                                    num_kv_pages=16, num_checkpoint_slots=4))
    store.evictor.clock = FakeClock()
    a = cache_tokens(store, pages(1)).nodes
    cache_tokens(store, pages(2))
    assert a[0].state_slot is not None
    store.retain(a, [(100, None)])
    assert store.evict_checkpoints(1) == 1
    assert a[0].state_slot is not None  # [2]'s state went, though A's is older
    assert store.match_prefix(pages(2), count_hits=False).num_matched_tokens == 0
    store.assert_invariants()


def test_retain_checks_its_path():
    store, paths = _four_leaves()
    with pytest.raises(ValueError):
        store.retain(paths["A"] + paths["B"], [(100, None)] * 2)  # not a path
    with pytest.raises(ValueError):
        store.retain(paths["A"], [(100, None)] * 2)  # one priority a node


# Lower tiers -------------------------------------------------------------------------------
def test_dram_keeps_a_retained_page_while_another_can_go():
    from tier_helpers import make_tiered, run_request
    from tier_helpers import pages as tier_pages

    from backend.cache.base import Tier

    def dram_victim(retain_a: bool) -> str:
        store, tiers = make_tiered(None, num_kv_pages=4, host_pages=2)
        a, _ = run_request(store, tiers, tier_pages(1))
        run_request(store, tiers, tier_pages(2))
        if retain_a:
            store.retain(a, [(100, None)])
        assert store.evict(2) == 2  # both to DRAM: its two slots are full
        run_request(store, tiers, tier_pages(3))
        assert store.evict(1) == 1  # C needs a DRAM slot: A (oldest) or B goes
        tiers.assert_invariants()
        kept = "".join(name for i, name in enumerate("AB", 1)
                       if store.match_prefix(tier_pages(i), count_hits=False).nodes)
        for i in (1, 2, 3):
            nodes = store.match_prefix(tier_pages(i), count_hits=False).nodes
            assert all(n.kv_location == Tier.HOST for n in nodes)
        tiers.close()
        return kept

    assert dram_victim(retain_a=False) == "B"
    assert dram_victim(retain_a=True) == "A"
