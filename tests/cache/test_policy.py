"""Look-ahead LRU (PCR) and plain LRU eviction order."""

from __future__ import annotations

from cache_helpers import cache_tokens, make_store, pages

from backend.cache import PrefixStore


def _pcr_store(window: int) -> tuple[PrefixStore, dict[int, str]]:
    """PCR's prefix tree before C9 arrives, in a store of exactly 8 pages:

    C1 - C2          leaves by age (oldest first): C2, C4, C6, C8
       \\ C3 - C4
    C5 - C6
    C7 - C8
    """
    store = make_store(num_kv_pages=8, lookahead_window=window)
    names: dict[int, str] = {}
    for chunks in ([1, 2], [1, 3, 4], [5, 6], [7, 8]):
        result = cache_tokens(store, pages(*chunks))
        for chunk, node in zip(chunks, result.nodes):
            names[id(node)] = f"C{chunk}"
    assert [names[id(n)] for n in store.evictable_leaves()] == ["C2", "C4", "C6", "C8"]
    return store, names


def _serve_c9(store: PrefixStore, names: dict[int, str]) -> None:
    """The running request matches C7, C8 and needs one new page for C9 (pool is full)."""
    result = cache_tokens(store, pages(7, 8, 9))
    names[id(result.nodes[-1])] = "C9"
    store.assert_invariants()


def _leaf_names(store: PrefixStore, names: dict[int, str]) -> set[str]:
    return {names[id(n)] for n in store.evictable_leaves()}


def test_pcr_worked_example_plain_lru_evicts_the_oldest_leaf():
    store, names = _pcr_store(window=0)
    store.protect([(pages(1, 2, 10), None)])  # W = 0: the waiting request is not looked at
    _serve_c9(store, names)
    assert _leaf_names(store, names) == {"C4", "C6", "C9"}
    assert store.stats.protected_pages_passed_over == 0
    assert store.match_prefix(pages(1, 2)).num_matched_pages == 1  # C2 is gone


def test_pcr_worked_example_lookahead_keeps_c2_and_evicts_c4():
    store, names = _pcr_store(window=1)
    # The next waiting request needs C1 -> C2: its pages get priority.
    assert store.protect([(pages(1, 2, 10), None)]) == 2
    _serve_c9(store, names)
    # C4 went, so C3 became a leaf; C9 replaced C8. PCR lists the set as {C6, C2, C3, C9}.
    assert _leaf_names(store, names) == {"C6", "C2", "C3", "C9"}
    assert store.stats.protected_pages_passed_over == 1
    assert store.stats.page_evictions_by_reason["capacity"] == 1
    assert store.match_prefix(pages(1, 2)).num_matched_pages == 2  # the look-ahead hit
    assert store.match_prefix(pages(1, 3, 4)).num_matched_pages == 2


def test_window_limits_protection_to_the_first_w_requests():
    store, _ = _pcr_store(window=1)
    # C4's request is second in the queue, outside W = 1: only C1, C2 are protected.
    assert store.protect([(pages(1, 2), None), (pages(1, 3, 4), None)]) == 2
    assert store.evict(1) == 1
    assert store.match_prefix(pages(1, 3, 4)).num_matched_pages == 2  # C4 evicted


def test_a_new_protect_call_replaces_the_old_protection():
    store, _ = _pcr_store(window=2)
    store.protect([(pages(1, 2), None)])
    store.protect([])
    assert store.evict(1) == 1
    assert store.match_prefix(pages(1, 2)).num_matched_pages == 1  # C2 evicted again


def test_protection_is_priority_not_a_pin():
    store, _ = _pcr_store(window=4)
    store.protect(
        [(pages(1, 2), None), (pages(1, 3, 4), None), (pages(5, 6), None), (pages(7, 8), None)]
    )
    assert store.evict(8) == 8  # everything protected still goes when nothing else can
    assert store.num_cached_pages == 0
    store.assert_invariants()


def test_protect_respects_salts():
    store, _ = _pcr_store(window=2)
    assert store.protect([(pages(1, 2), "other-tenant")]) == 0


def test_a_match_refreshes_a_leaf():
    store, _ = _pcr_store(window=0)
    store.match_prefix(pages(1, 2))  # C2 becomes the most recently used leaf
    assert store.evict(1) == 1
    assert store.match_prefix(pages(1, 3, 4)).num_matched_pages == 2  # C4 was the oldest
    assert store.match_prefix(pages(1, 2)).num_matched_pages == 2


def test_evicting_a_leaf_exposes_its_parent_in_order():
    store, _ = _pcr_store(window=0)
    # C3's last access is C4's insert, older than C6 and C8: after C2 and C4 it is next.
    assert store.evict(3) == 3
    assert store.match_prefix(pages(1, 3)).num_matched_pages == 1
    assert store.match_prefix(pages(5, 6)).num_matched_pages == 2
    store.assert_invariants()


def test_locked_leaves_are_skipped_and_return_after_unlock():
    store, _ = _pcr_store(window=0)
    match = store.match_prefix(pages(1, 2))
    store.lock(match.nodes)
    assert store.evict(1) == 1
    assert store.match_prefix(pages(1, 2)).num_matched_pages == 2
    store.unlock(match.nodes)
    store.assert_invariants()


def test_eviction_of_many_leaves_stays_consistent():
    store = make_store(num_kv_pages=64, page_size=2, anchor_density=0.5)
    for i in range(32):
        cache_tokens(store, [i, i, i + 100, i + 100])
    for i in range(0, 32, 3):
        store.match_prefix([i, i, i + 100, i + 100])
    assert store.evict(40) == 40
    store.assert_invariants()
    assert store.num_cached_pages == 24


def test_stale_heap_entries_are_compacted():
    store = make_store(num_kv_pages=8)
    cache_tokens(store, pages(1, 2))
    for _ in range(3000):  # every match of a leaf pushes a fresh entry
        store.match_prefix(pages(1, 2))
    assert len(store.policy.leaves) <= 2 * store.num_cached_pages + 1024 + 1
    store.assert_invariants()
    assert store.evict(2) == 2
