"""PrefixStore behaviour a caller relies on: allocation under pressure, locking, duplicate
pages, tenant isolation, bad arguments, and the tier hook (demote / promote / drop)."""

from __future__ import annotations

import pytest
from cache_helpers import cache_tokens, make_store, pages

from backend.cache import EvictAction, EvictDecision, Tier, TierBackend


def test_allocation_fails_softly_when_everything_is_locked_and_recovers_after_unlock():
    store = make_store(num_kv_pages=4)
    cache_tokens(store, pages(1, 2, 3, 4))
    match = store.match_prefix(pages(1, 2, 3, 4))
    store.lock(match.nodes)
    assert store.alloc_pages(1) is None  # no exception: the caller waits
    store.assert_invariants()
    store.unlock(match.nodes)
    alloc = store.alloc_pages(2)
    assert alloc is not None and len(alloc.kv_pages) == len(alloc.anchor_blocks) == 2
    assert store.match_prefix(pages(1, 2, 3, 4)).num_matched_pages == 2
    assert store.stats.page_evictions_by_reason["capacity"] == 2
    store.assert_invariants()


def test_asking_for_more_than_the_pool_holds_is_an_error():
    store = make_store(num_kv_pages=4)
    with pytest.raises(ValueError, match="pool holds 4"):
        store.alloc_pages(5)


def test_locked_inner_nodes_keep_their_children_evictable():
    store = make_store()
    cache_tokens(store, pages(1, 2, 3))
    store.lock(store.match_prefix(pages(1)).nodes)
    assert store.evict(10) == 2  # pages 3 and 2 go, page 1 is locked
    assert store.match_prefix(pages(1, 2, 3)).num_matched_pages == 1


def test_reinserting_reports_duplicates_and_keeps_the_tree_pages():
    store = make_store()
    first = cache_tokens(store, pages(1, 2))
    alloc = store.alloc_pages(3)
    result = store.insert(pages(1, 2, 3), None, alloc.kv_pages, alloc.anchor_blocks)
    assert result.num_new_pages == 1
    assert result.duplicate_kv_pages == alloc.kv_pages[:2]
    assert result.duplicate_anchor_blocks == alloc.anchor_blocks[:2]
    assert [n.kv_page for n in result.nodes[:2]] == [n.kv_page for n in first.nodes]
    store.free_pages(result.duplicate_kv_pages, result.duplicate_anchor_blocks)
    store.assert_invariants()
    assert store.stats.pages_inserted == 3


def test_passing_back_the_matched_ids_is_not_a_duplicate():
    store = make_store()
    cache_tokens(store, pages(1, 2))
    result = cache_tokens(store, pages(1, 2, 3))
    assert result.duplicate_kv_pages == [] and result.num_new_pages == 1


def test_tenants_never_share_pages():
    store = make_store()
    cache_tokens(store, pages(1, 2), salt="alice")
    assert store.match_prefix(pages(1, 2), "bob").num_matched_pages == 0
    assert store.match_prefix(pages(1, 2)).num_matched_pages == 0
    result = cache_tokens(store, pages(1, 2), salt="bob")
    assert result.num_new_pages == 2
    store.assert_invariants()


def test_insert_rejects_ids_the_caller_does_not_hold():
    store = make_store()
    cache_tokens(store, pages(1))
    tree_page = store.match_prefix(pages(1)).kv_pages[0]
    alloc = store.alloc_pages(1)
    with pytest.raises(ValueError, match="not held"):
        store.insert(pages(2), None, [tree_page], alloc.anchor_blocks)
    with pytest.raises(ValueError, match="anchor blocks"):
        store.insert(pages(2), None, alloc.kv_pages, [])
    with pytest.raises(ValueError, match="KV pages for"):
        store.insert(pages(2)[:3], None, alloc.kv_pages, alloc.anchor_blocks)
    with pytest.raises(ValueError, match="page boundary"):
        store.insert(pages(2), None, alloc.kv_pages, alloc.anchor_blocks, {3: 0})
    store.assert_invariants()


def test_freeing_tree_pages_or_unlocking_twice_raises():
    store = make_store()
    result = cache_tokens(store, pages(1))
    with pytest.raises(ValueError, match="not held"):
        store.free_pages([result.nodes[0].kv_page])
    store.lock(result.nodes)
    store.unlock(result.nodes)
    with pytest.raises(ValueError, match="not locked"):
        store.unlock(result.nodes)


def test_lock_needs_a_path_from_the_root():
    store = make_store()
    result = cache_tokens(store, pages(1, 2, 3))
    with pytest.raises(ValueError):
        store.lock(result.nodes[1:])
    with pytest.raises(ValueError):
        store.lock([result.nodes[0], result.nodes[2]])
    store.lock([])  # an empty match locks nothing


def test_none_policy_hands_every_page_back():
    store = make_store(policy="none")
    alloc = store.alloc_pages(2)
    assert alloc.anchor_blocks == []
    result = store.insert(pages(1, 2), None, alloc.kv_pages)
    assert result.num_new_pages == 0 and result.duplicate_kv_pages == alloc.kv_pages
    store.free_pages(result.duplicate_kv_pages)
    assert store.match_prefix(pages(1, 2)).num_matched_pages == 0
    store.assert_invariants()


def test_stats_count_hits_in_tokens():
    store = make_store()
    cache_tokens(store, pages(1, 2))
    store.match_prefix(pages(1, 2, 3))
    stats = store.stats.as_dict()
    assert stats["hit_tokens_by_tier"]["device"] == 8
    assert stats["num_queried_tokens"] == 8 + 12


class HostTier(TierBackend):
    """A fake DRAM tier: demotes everything (or drops, when told), records the calls."""

    def __init__(self) -> None:
        self.host: dict[int, int] = {}
        self.drop = False
        self.removed = 0

    def on_evict(self, node):
        if self.drop:
            return EvictDecision(EvictAction.DROP)
        self.host[id(node)] = node.kv_page
        return EvictDecision(EvictAction.DEMOTE, Tier.HOST, Tier.HOST)

    def on_promote(self, node, kv_page, anchor_block):
        assert id(node) in self.host and anchor_block is not None

    def on_remove(self, node):
        self.host.pop(id(node), None)
        self.removed += 1


def test_demoted_pages_stay_matchable_and_promote_back():
    tier = HostTier()
    store = make_store(tier, num_kv_pages=3)
    cache_tokens(store, pages(1, 2, 3))
    assert store.evict(2) == 2  # pages 3 then 2 leave the device, not the tree
    match = store.match_prefix(pages(1, 2, 3))
    assert match.num_matched_pages == 3 and len(match.kv_pages) == 1
    assert store.stats.hit_tokens_by_tier[Tier.HOST] == 8
    store.assert_invariants()
    store.lock(match.nodes)
    assert store.promote(match.nodes)
    assert all(n.on_device for n in match.nodes)
    assert store.stats.pages_promoted == 2
    store.unlock(match.nodes)
    store.assert_invariants()


def test_promote_needs_a_locked_path_and_fails_softly_without_room():
    store = make_store(HostTier(), num_kv_pages=2)
    cache_tokens(store, pages(1, 2))
    store.evict(1)
    match = store.match_prefix(pages(1, 2))
    with pytest.raises(ValueError, match="locked"):
        store.promote(match.nodes)
    held = store.alloc_pages(1)  # the last free page is now the caller's
    store.lock(match.nodes)
    assert not store.promote(match.nodes)  # page 1 is locked: nothing can make room
    store.free_pages(held.kv_pages, held.anchor_blocks)
    assert store.promote(match.nodes)
    store.assert_invariants()


def test_dropping_a_page_drops_its_demoted_descendants():
    tier = HostTier()
    store = make_store(tier)
    cache_tokens(store, pages(1, 2, 3))
    store.evict(2)  # pages 3, 2 demoted
    tier.drop = True
    assert store.evict(1) == 1  # page 1 is now a device leaf; dropping it takes 2 and 3
    assert store.num_cached_pages == 0 and tier.removed == 3 and not tier.host
    store.assert_invariants()


def test_demote_must_name_a_lower_tier():
    class BadTier(TierBackend):
        def on_evict(self, node):
            return EvictDecision(EvictAction.DEMOTE, Tier.DEVICE, Tier.HOST)

    store = make_store(BadTier())
    cache_tokens(store, pages(1))
    with pytest.raises(ValueError, match="lower tier"):
        store.evict(1)
    store.assert_invariants()  # the bad answer changed nothing


def test_max_cached_pages_trims_idle_pages_and_spares_locked_ones():
    store = make_store(max_cached_pages=3)
    running = cache_tokens(store, pages(1, 2, 3, 4, 5))
    store.lock(running.nodes)  # a running request holds all five
    assert store.num_idle_device_pages == 0 and store.trim() == 0
    idle = cache_tokens(store, pages(6, 7, 8, 9))
    assert store.num_idle_device_pages == 4
    assert store.trim() == 1 and store.num_idle_device_pages == 3  # the LRU leaf went
    assert store.match_prefix(pages(6, 7, 8, 9)).num_matched_pages == 3
    store.unlock(running.nodes)
    assert store.trim() == 5 and store.num_idle_device_pages == 3
    store.assert_invariants()
    assert idle is not None


def test_without_max_cached_pages_the_whole_pool_caches():
    store = make_store()
    cache_tokens(store, pages(1, 2, 3, 4, 5))
    assert store.trim() == 0 and store.num_idle_device_pages == 5
