"""The invariants of `PrefixStore`, written down once and checked by `assert_invariants()`.

Tree
  T1  Every node is alive, is its parent's child under its own key, has a key of page_size
      int32 ids and depth = parent depth + 1. Roots (one per salt) have no parent, depth -1,
      and at least one child (a root is dropped with its last child).
Locks
  L1  lock_ref >= 0 and lock_ref(node) >= sum of its children's lock_ref: a lock always
      covers the whole path from the root, so a locked node's ancestors are locked.
  L2  The store's count of locked device pages (`max_cached_pages` trims the others) is the
      number of nodes that are locked and on the device.
Residency
  R1  kv_location is DEVICE exactly when kv_page is set; every node has a KV copy somewhere
      (a node leaves the tree when its last copy goes).
  R2  Device residency is top-closed: a node on the device has its parent on the device, so
      only device leaves (no child on the device) are evicted from the device.
  R3  num_device_children counts the children on the device.
  R4  KV and anchors are admitted and evicted together: under suffixreplay every node has an
      anchor copy somewhere and anchor_location is DEVICE exactly when anchor_block is set;
      under the other policies no node has anchors. The "none" policy caches nothing.
Pools (exact accounting, for each of KV pages, anchor blocks and checkpoint slots)
  P1  No id is referenced by two nodes, and no id is both referenced and caller-held.
  P2  Allocated ids == ids referenced by nodes + ids held by callers.
Policy
  E1  Every eviction candidate (unlocked device leaf; any node with a checkpoint) has a
      valid entry in its LRU heap, so nothing evictable is ever lost from view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.cache.base import Tier
from backend.cache.policy import has_evictable_state, is_evictable_leaf

if TYPE_CHECKING:
    from backend.cache.radix import PageNode
    from backend.cache.store import PrefixStore


def check_store(store: PrefixStore) -> None:
    nodes = list(store.tree.iter_nodes())
    _check_roots(store)
    for node in nodes:
        _check_node(store, node)
    _check_pools(store, nodes)
    _check_heaps(store, nodes)
    locked = sum(1 for n in nodes if n.lock_ref and n.on_device)
    assert store.evictor.num_locked_device == locked, (
        f"L2: {store.evictor.num_locked_device} locked device pages counted, {locked} in the tree")


def _check_roots(store: PrefixStore) -> None:
    for salt, root in store.tree.roots.items():
        assert root.parent is None and root.depth == -1 and root.salt == salt, root
        assert root.children, f"T1: empty root for salt {salt!r} was not dropped"
        assert root.lock_ref == 0, "roots are never locked"
        on_device = sum(c.on_device for c in root.children.values())
        assert root.num_device_children == on_device, "R3 (root)"
    assert store.tree.num_nodes == sum(1 for _ in store.tree.iter_nodes()), "node count"


def _check_node(store: PrefixStore, node: PageNode) -> None:
    parent = node.parent
    assert node.alive and parent is not None and parent.alive, f"T1: {node!r}"
    assert parent.children.get(node.key) is node, f"T1: {node!r} not under its key"
    assert len(node.key) == store.tree.page_bytes, f"T1: key size of {node!r}"
    assert node.depth == parent.depth + 1, f"T1: depth of {node!r}"
    assert node.salt == parent.salt, f"T1: salt of {node!r}"
    assert node.lock_ref >= 0, f"L1: {node!r}"
    child_locks = sum(c.lock_ref for c in node.children.values())
    assert node.lock_ref >= child_locks, f"L1: {node!r} locks {node.lock_ref} < {child_locks}"
    assert node.kv_location is not None, f"R1: {node!r} has no KV copy"
    assert (node.kv_location == Tier.DEVICE) == (node.kv_page is not None), f"R1: {node!r}"
    if node.on_device:
        assert parent.on_device, f"R2: {node!r} on device under an off-device parent"
    on_device = sum(c.on_device for c in node.children.values())
    assert node.num_device_children == on_device, f"R3: {node!r}"
    assert store.config.policy != "none", "R4: the none policy cached a page"
    if store.uses_anchors:
        assert node.anchor_location is not None, f"R4: {node!r} lost its anchors"
        on_dev = node.anchor_location == Tier.DEVICE
        assert on_dev == (node.anchor_block is not None), f"R4: {node!r}"
    else:
        assert node.anchor_location is None and node.anchor_block is None, f"R4: {node!r}"


def _check_pools(store: PrefixStore, nodes: list[PageNode]) -> None:
    for pool, held, refs in (
        (store.kv_pool, store.kv.ids, [n.kv_page for n in nodes]),
        (store.anchor_pool, store.anchors.ids, [n.anchor_block for n in nodes]),
        (store.state_pool, store.states.ids, [n.state_slot for n in nodes]),
    ):
        pool.check()
        referenced = [i for i in refs if i is not None]
        ref_set = set(referenced)
        assert len(ref_set) == len(referenced), f"P1: a {pool.name} id is on two nodes"
        assert not ref_set & held, f"P1: {pool.name} ids both referenced and held"
        allocated = pool.allocated_ids()
        assert allocated == ref_set | held, (
            f"P2: {pool.name} allocated={len(allocated)} referenced={len(ref_set)} "
            f"held={len(held)} leaked={sorted(allocated - ref_set - held)[:5]} "
            f"unallocated={sorted((ref_set | held) - allocated)[:5]}"
        )


def _check_heaps(store: PrefixStore, nodes: list[PageNode]) -> None:
    leaf_entries = store.policy.leaves.valid_nodes()
    state_entries = store.policy.states.valid_nodes()
    for node in nodes:
        if is_evictable_leaf(node):
            assert id(node) in leaf_entries, f"E1: leaf {node!r} missing from the LRU heap"
        if has_evictable_state(node):
            assert id(node) in state_entries, f"E1: checkpoint of {node!r} missing from its LRU"
