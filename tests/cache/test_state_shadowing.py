"""Suffix replay's state order: a state shadowed by a deeper one on its path goes before the
others (LRU among themselves); a state several requests resumed from is a branch point and
keeps its place; the checkpoint baseline keeps plain LRU."""

from __future__ import annotations

import pytest
from cache_helpers import make_store

P = 4  # make_store's page size


def _insert(store, tokens, state_positions):
    """Caches `tokens` (whole pages) with a fresh state slot at each position; returns the
    path's nodes."""
    match = store.match_prefix(tokens)
    store.lock(match.nodes)
    alloc = store.alloc_pages(len(tokens) // P - match.num_matched_pages)
    slots = store.alloc_state_slots(len(state_positions))
    result = store.insert(tokens, None, match.kv_pages + alloc.kv_pages,
                          match.anchor_blocks + alloc.anchor_blocks,
                          dict(zip(state_positions, slots, strict=True)))
    store.unlock(match.nodes)
    store.free_pages(result.duplicate_kv_pages, result.duplicate_anchor_blocks)
    store.free_state_slots(result.duplicate_state_slots)
    return result.nodes


def _with_states(store):
    return {n.depth: n for n in store.tree.iter_nodes() if n.state_slot is not None}


def _seq(start, n=4 * P):
    return list(range(start, start + n))


def test_a_shadowed_state_goes_before_older_ones_and_lru_among_shadowed():
    store = make_store()  # suffixreplay, 4 slots
    old = _insert(store, _seq(100), [2 * P])  # the oldest state, another path
    path = _insert(store, _seq(0), [P, 2 * P, 4 * P])
    assert store.shadow_states(path[:2]) == 2  # the states at 1 and 2 pages
    store.assert_invariants()
    assert store.evictor.evict_states(1, "capacity") == 1
    assert path[0].state_slot is None  # the least recent shadowed one went first
    assert path[1].state_slot is not None and old[1].state_slot is not None
    store.evictor.evict_states(1, "capacity")
    assert path[1].state_slot is None and old[1].state_slot is not None
    store.evictor.evict_states(1, "capacity")  # no shadowed one left: plain LRU
    assert old[1].state_slot is None and path[3].state_slot is not None
    assert store.stats.shadowed_states == 2
    store.assert_invariants()


def test_a_lookup_keeps_a_shadowed_state_first_until_requests_resume_from_it():
    store = make_store()
    other = _insert(store, _seq(100), [2 * P])
    path = _insert(store, _seq(0, 2 * P), [2 * P])
    deeper = _insert(store, _seq(0, 4 * P), [4 * P])
    assert store.shadow_states(deeper[:2]) == 1
    match = store.match_prefix(_seq(0, 2 * P) + [999] * P)  # its deepest state: path[1]
    assert match.checkpoint.node is path[1]
    assert path[1].state_shadowed  # recent among the shadowed, still behind the others
    store.resumed_from(path[1])
    assert path[1].state_shadowed and path[1].state_uses == 1
    store.match_prefix(_seq(0, 2 * P) + [998] * P)
    store.resumed_from(path[1])  # a second request resumed from it: a branch point
    assert not path[1].state_shadowed and path[1].state_uses == 2
    assert store.shadow_states(deeper[:2]) == 0  # and it is not shadowed again
    store.evictor.evict_states(1, "capacity")
    assert other[1].state_slot is None and path[1].state_slot is not None
    store.assert_invariants()


def test_a_new_state_in_a_freed_slot_starts_unshadowed_and_unused():
    store = make_store(num_checkpoint_slots=1)
    path = _insert(store, _seq(0, 2 * P), [2 * P])
    store.resumed_from(path[1])
    store.shadow_states(path[:2])
    store.evictor.evict_states(1, "capacity")
    again = _insert(store, _seq(0, 2 * P), [2 * P])
    assert again[1] is path[1] and path[1].state_slot is not None
    assert not path[1].state_shadowed and path[1].state_uses == 0


@pytest.mark.parametrize("options", [dict(policy="checkpoint"),
                                     dict(shadowed_states_first=False)],
                         ids=["checkpoint-policy", "option-off"])
def test_shadowing_is_suffix_replays_and_can_be_turned_off(options):
    store = make_store(**options)
    path = _insert(store, _seq(0), [2 * P, 4 * P])
    assert store.shadow_states(path[:2]) == 0
    assert not any(n.state_shadowed for n in _with_states(store).values())
    assert store.stats.shadowed_states == 0


def test_shadow_states_takes_a_path_only():
    store = make_store()
    a = _insert(store, _seq(0), [P])
    b = _insert(store, _seq(100), [P])
    with pytest.raises(ValueError, match="not a child"):
        store.shadow_states([a[0], b[1]])
