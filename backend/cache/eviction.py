"""Eviction mechanics of the prefix store: take victims from the policy's heaps, ask the tier
backend what each page becomes (demoted or dropped), return the freed device ids to the pools.

Only unlocked device leaves leave the device (invariants R2, E1 in `invariants.py`); a
dropped node takes its lower-tier descendants with it, since they are unreachable without it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence

from backend.cache.base import EvictAction, Tier, TierBackend
from backend.cache.policy import LookaheadLRU, has_evictable_state, is_evictable_leaf
from backend.cache.pools import PagePool
from backend.cache.radix import PageNode, RadixTree
from backend.cache.retention import (
    DEFAULT_PRIORITY,
    PagePriority,
    keep_grant,
    outlasts,
    strongest,
)
from backend.cache.stats import RESET, WITH_PAGE, CacheStats

# Requests resuming from a state that make it a branch point (never shadowed).
SHARED_STATE_USES = 2


class Evictor:
    """Evicts pages and checkpoints of one store (shares its tree, pools, policy and stats)."""

    def __init__(
        self,
        tree: RadixTree,
        pools: tuple[PagePool, PagePool, PagePool],
        policy: LookaheadLRU,
        tier: TierBackend,
        stats: CacheStats,
        uses_anchors: bool,
    ) -> None:
        self.tree = tree
        self.kv_pool, self.anchor_pool, self.state_pool = pools
        self.policy = policy
        self.tier = tier
        self.stats = stats
        self.uses_anchors = uses_anchors
        self.num_locked_device = 0  # device pages on some running request's locked path
        # Retention priorities: expiries (when, seq, node) in a min-heap, on this clock
        # (seconds; tests replace it).
        self.clock = time.monotonic
        self._expiries: list[tuple[float, int, PageNode]] = []
        self._expiry_seq = itertools.count()

    # Retention --------------------------------------------------------------------------
    def priority_of(self, node: PageNode) -> int:
        """`node`'s retention priority now (an expired one gives way to the strongest grant
        still running, else the default)."""
        now = self.clock()
        until = node.priority_until
        if until is None or now < until:
            return node.priority
        live = [p for p, u in node.priority_later if u is None or now < u]
        return max(live, default=DEFAULT_PRIORITY)

    def retain(self, nodes: Sequence[PageNode], priorities: Sequence[PagePriority],
               log: bool = True) -> int:
        """Gives each node the given priority where no request gave it one yet, else raises
        it (`retention.py`: a higher priority, or the same one expiring later); a grant it
        does not raise is kept for later where it outlasts the current one (when that ends,
        the strongest grant still running takes over: one request's shorter raise does not
        end another's longer priority). Returns how many nodes' priority changed. Each grant
        kept goes to the tier (`on_retain`) unless `log` is false (a priority the tier
        itself restored)."""
        self.expire()
        now = self.clock()
        changed = 0
        for node, (priority, duration) in zip(nodes, priorities, strict=True):
            until = None if duration is None else now + duration
            if not node.priority_set:
                node.priority_later = []
            elif priority < node.priority or (
                    priority == node.priority and not outlasts(until, node.priority_until)):
                # Not a raise: kept for later where it outlasts the current grant
                # (the default for good is what every grant ends in: nothing to keep)
                if outlasts(until, node.priority_until) and \
                        (priority, until) != (DEFAULT_PRIORITY, None) and \
                        keep_grant(node.priority_later, (priority, until)):
                    if log:
                        self.tier.on_retain(node, priority, duration)
                continue
            else:  # a raise: the grants that outlast it stay for later
                later = [(node.priority, node.priority_until), *node.priority_later]
                node.priority_later = []
                for grant in later:
                    if outlasts(grant[1], until):
                        keep_grant(node.priority_later, grant)
            node.priority, node.priority_until, node.priority_set = priority, until, True
            if until is not None:
                heapq.heappush(self._expiries, (until, next(self._expiry_seq), node))
            if log:
                self.tier.on_retain(node, priority, duration)
            self.push_leaf(node)
            self.push_state(node)
            changed += 1
        return changed

    def expire(self) -> None:
        """Priorities whose duration ended give way to the strongest grant still running,
        else revert to the default (and their nodes take their place in the eviction order
        again)."""
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            until, _, node = heapq.heappop(self._expiries)
            if not (node.alive and node.priority_until == until):
                continue
            live = [g for g in node.priority_later if g[1] is None or g[1] > now]
            if live:
                best = strongest(live)
                live.remove(best)
                node.priority, node.priority_until = best
                node.priority_later = live
                if best[1] is not None:
                    heapq.heappush(self._expiries, (best[1], next(self._expiry_seq), node))
            else:
                node.priority, node.priority_until = DEFAULT_PRIORITY, None
                node.priority_set, node.priority_later = False, []
            self.push_leaf(node)
            self.push_state(node)

    def evict_pages(self, num_pages: int, reason: str) -> int:
        """Up to `num_pages` device leaves in policy order; returns how many went."""
        self.expire()
        evicted = 0
        try:
            while evicted < num_pages:
                node = self.policy.leaves.pop()
                if node is None:
                    break
                try:
                    self._evict_leaf(node)
                except Exception:
                    self.policy.leaves.push(node)  # a refused victim stays in view (E1)
                    raise
                evicted += 1
        finally:
            self.policy.leaves.end_pass()
            self.stats.page_evictions_by_reason[reason] += evicted
            self.stats.protected_pages_passed_over = self.policy.num_passed_over
        return evicted

    def evict_states(self, num_slots: int, reason: str) -> int:
        """Up to `num_slots` checkpoints in their own LRU order (their pages stay)."""
        self.expire()
        evicted = 0
        try:
            while evicted < num_slots:
                node = self.policy.states.pop()
                if node is None:
                    break
                self.drop_state(node, reason)
                evicted += 1
        finally:
            self.policy.states.end_pass()
            self.stats.protected_pages_passed_over = self.policy.num_passed_over
        return evicted

    def drop_state(self, node: PageNode, reason: str, spill: bool = True) -> None:
        """Frees a checkpoint's device slot; with `spill` (the node stays in the tree) the
        tier backend may keep the state on a lower tier first."""
        if spill:
            self.tier.on_state_evict(node, node.state_slot)
        self.state_pool.free([node.state_slot])
        node.state_slot = None
        self.stats.checkpoint_evictions_by_reason[reason] += 1

    def shadow_states(self, nodes: Sequence[PageNode]) -> int:
        """The device states of `nodes` go before every other state of their priority when
        slots run out (LRU among themselves), except the ones two requests or more resumed
        from since they were saved (branch points: a shared document, a tool tree's system
        prompt). A lookup keeps a shadowed state shadowed (recent among the shadowed ones:
        `PrefixStore.match_prefix`); the second request that resumes from it makes it
        recent again (`resumed_from`). Returns how many were shadowed now."""
        shadowed = 0
        for node in nodes:
            if node.state_slot is not None and node.state_uses < SHARED_STATE_USES \
                    and not node.state_shadowed:
                node.state_shadowed = True
                self.push_state(node)
                shadowed += 1
        self.stats.shadowed_states += shadowed
        return shadowed

    def resumed_from(self, node: PageNode) -> None:
        """A request loaded `node`'s state: counted; at SHARED_STATE_USES a shadowed state
        is a branch point, recent again and never shadowed from now on."""
        node.state_uses += 1
        if node.state_uses >= SHARED_STATE_USES and node.state_shadowed:
            node.state_shadowed = False
            if node.state_slot is not None:
                self.push_state(node)

    def push_leaf(self, node: PageNode) -> None:
        """Puts `node` (back) in view of the page LRU if it is a candidate now."""
        if is_evictable_leaf(node):
            self.policy.leaves.push(node)
            if len(self.policy.leaves) > 2 * self.tree.num_nodes + 1024:
                self.policy.leaves.compact(
                    n for n in self.tree.iter_nodes() if is_evictable_leaf(n)
                )

    def push_state(self, node: PageNode) -> None:
        if has_evictable_state(node):
            self.policy.states.push(node)
            if len(self.policy.states) > 2 * self.state_pool.num_used + 1024:
                self.policy.states.compact(
                    n for n in self.tree.iter_nodes() if has_evictable_state(n)
                )

    def _evict_leaf(self, node: PageNode) -> None:
        decision = self.tier.on_evict(node)
        if node.priority > DEFAULT_PRIORITY:
            self.stats.retained_page_evictions += 1
        if decision.action == EvictAction.DEMOTE:
            self._check_demotion(decision.kv_location, decision.anchor_location)
        parent = node.parent
        self._release_device_ids(node, spill=decision.action == EvictAction.DEMOTE)
        parent.num_device_children -= 1
        if decision.action == EvictAction.DROP:
            self.remove_subtree(node)
        else:
            node.kv_location = decision.kv_location
            node.anchor_location = decision.anchor_location if self.uses_anchors else None
            self.stats.pages_demoted += 1
        self.push_leaf(parent)

    def _check_demotion(self, kv_tier: Tier | None, anchor_tier: Tier | None) -> None:
        if kv_tier is None or kv_tier == Tier.DEVICE:
            raise ValueError(f"DEMOTE must name a lower tier for the KV, got {kv_tier}")
        if self.uses_anchors and (anchor_tier is None or anchor_tier == Tier.DEVICE):
            raise ValueError(f"DEMOTE must name a lower tier for the anchors, got {anchor_tier}")

    def _release_device_ids(self, node: PageNode, spill: bool) -> None:
        self.kv_pool.free([node.kv_page])
        node.kv_page = None
        node.kv_location = None
        if node.anchor_block is not None:
            self.anchor_pool.free([node.anchor_block])
            node.anchor_block = None
            node.anchor_location = None
        if node.state_slot is not None:
            self.drop_state(node, WITH_PAGE, spill)

    def drop_unlocked(self, top: PageNode) -> tuple[int, int]:
        """Removes every node under `top` (a root) that no running request holds, on every
        tier: device ids freed, lower-tier copies released by the backend's `on_remove`.
        A locked node stays, whole (its KV is a running request's), and so do its locked
        descendants. Returns (nodes removed, nodes kept)."""
        removed = kept = 0
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref:  # a node's lock_ref bounds its children's: look below it
                kept += 1
                stack.extend(node.children.values())
                continue
            subtree = [node]  # unlocked: so is everything below it
            for n in subtree:
                subtree.extend(n.children.values())
            if node.on_device:
                node.parent.num_device_children -= 1
            for n in subtree:
                if n.state_slot is not None:
                    self.drop_state(n, RESET, spill=False)
                if n.on_device:
                    self._release_device_ids(n, spill=False)
            self.remove_subtree(node)
            removed += len(subtree)
        self.stats.page_evictions_by_reason[RESET] += removed
        return removed, kept

    def remove_subtree(self, node: PageNode) -> None:
        """Removes `node` and its descendants from the tree, children first (iterative: a
        chain of lower-tier pages can be deeper than Python's recursion limit)."""
        # None of these is locked: a node's lock_ref bounds the sum of its children's, and
        # `node` itself is unlocked.
        order = []
        stack = [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # every node comes after its ancestors in `order`
            if n.state_slot is not None:
                self.drop_state(n, WITH_PAGE, spill=False)
            self.tier.on_remove(n)
            self.tree.remove_leaf(n)
