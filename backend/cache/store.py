"""`PrefixStore`: the radix tree of pages wired to its pools, eviction policy and tier backend.

Life of a request (single engine thread; the store is not thread-safe):
  match_prefix -> lock(match.nodes) -> [promote] -> alloc_pages for the new pages ->
  prefill (capture anchors / checkpoints into the allocated ids) -> insert ->
  lock(insert.nodes), unlock(match.nodes), free duplicates -> ... -> unlock(insert.nodes).
The invariants the store keeps are written down in `backend/cache/invariants.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from backend.cache.admission import Admitter
from backend.cache.base import (
    DropTier,
    InsertResult,
    MatchResult,
    PageAllocation,
    StateCheckpoint,
    Tier,
    TierBackend,
)
from backend.cache.checkpoint import checkpoint_positions, sglang_positions
from backend.cache.config import CacheConfig
from backend.cache.eviction import Evictor
from backend.cache.policy import LookaheadLRU, is_evictable_leaf
from backend.cache.pools import HeldIds, PagePool
from backend.cache.radix import TOKEN_BYTES, PageNode, RadixTree, encode_tokens, normalize_salt
from backend.cache.retention import PagePriority
from backend.cache.stats import CAPACITY, EXPLICIT, CacheStats


class PrefixStore:
    """Paged prefix cache: match, insert, lock/unlock, evict, allocate, protect."""

    def __init__(self, config: CacheConfig, tier: TierBackend | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.tree = RadixTree(config.page_size)
        self.kv = HeldIds(PagePool(config.num_kv_pages, "kv"), "KV page")
        self.anchors = HeldIds(PagePool(config.anchor_pool_size, "anchor"), "anchor block")
        self.states = HeldIds(PagePool(config.num_checkpoint_slots, "state"), "checkpoint slot")
        # Ids handed to callers by alloc_* are tracked in kv / anchors / states (HeldIds).
        self.kv_pool = self.kv.pool
        self.anchor_pool = self.anchors.pool
        self.state_pool = self.states.pool
        self.policy = LookaheadLRU(config.lookahead_window)
        self.stats = CacheStats()
        self.uses_anchors = config.uses_anchors
        self.evictor = Evictor(
            self.tree,
            (self.kv_pool, self.anchor_pool, self.state_pool),
            self.policy,
            tier if tier is not None else DropTier(),
            self.stats,
            self.uses_anchors,
        )
        self.admitter = Admitter(
            config, self.tree, (self.kv, self.anchors, self.states), self.evictor, self.stats
        )
        self._clock = 0
        self.tier.attach(self)

    @property
    def tier(self) -> TierBackend:
        return self.evictor.tier

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # Matching ---------------------------------------------------------------------------
    def match_prefix(self, tokens: Any, salt: str | None = None,
                     count_hits: bool = True) -> MatchResult:
        """Longest usable cached prefix of whole pages of `tokens` in namespace `salt`.

        tokens: int list / 1-D int array or tensor, or the bytes of `encode_tokens(tokens)`
        (encode once per request: it is the main per-token cost for Python lists). Marks the
        matched path as used (LRU). Callers that need logits for the last prompt token pass
        `tokens[:-1]` so that at least one token is recomputed. count_hits=False: the caller
        counts the pages it ends up using (`count_hits(locations(match)[:n])`).
        """
        key = encode_tokens(tokens)
        self.tier.on_lookup(salt)
        self.stats.num_match_requests += 1
        self.stats.num_queried_tokens += len(key) // TOKEN_BYTES
        if self.config.policy == "none":
            return MatchResult(0, 0, [], [], [], None, None, 0)
        nodes = self.tree.walk(key, salt)
        num_cached = len(nodes)
        last_state = -1
        for i, node in enumerate(nodes):
            if node.state_slot is not None:
                last_state = i
        if self.config.policy == "checkpoint":
            # A lower tier may hold deeper states (their device slots were reclaimed).
            for i in range(len(nodes) - 1, last_state, -1):
                if self.tier.has_state(nodes[i]):
                    last_state = i
                    break
            nodes = nodes[: last_state + 1]
        tick = self._tick()
        for node in nodes:
            node.last_access = tick
        checkpoint = None
        if last_state >= 0:
            node = nodes[last_state]
            checkpoint = StateCheckpoint(node, node.state_slot, (node.depth + 1) * self.page_size)
            # A shadowed state stays shadowed (recent among the shadowed ones) until requests
            # resume from it (`resumed_from`).
            node.state_access = tick
            if node.state_slot is not None:
                self.evictor.push_state(node)
        kv_pages, anchors = self._device_prefix(nodes)
        if kv_pages:
            self.evictor.push_leaf(nodes[len(kv_pages) - 1])
        live = checkpoint.slot if checkpoint and last_state == len(nodes) - 1 else None
        match = MatchResult(
            len(nodes),
            len(nodes) * self.page_size,
            nodes,
            kv_pages,
            anchors,
            checkpoint,
            live,
            num_cached,
        )
        if count_hits:
            self.count_hits(self.locations(match))
        return match

    @staticmethod
    def locations(match: MatchResult) -> list[Tier]:
        """Where each matched page is now, root child first (the device prefix first)."""
        num_device = len(match.kv_pages)
        return [Tier.DEVICE] * num_device + [n.kv_location for n in match.nodes[num_device:]]

    def count_hits(self, locations: Sequence[Tier]) -> None:
        """Counts pages served from the store, by the tier each was found on."""
        hits = self.stats.hit_tokens_by_tier
        for where in locations:
            hits[where] += self.page_size

    def _device_prefix(self, nodes: list[PageNode]) -> tuple[list[int], list[int]]:
        kv_pages: list[int] = []
        for node in nodes:
            if node.kv_page is None:
                break
            kv_pages.append(node.kv_page)
        anchors: list[int] = []
        if self.uses_anchors:
            for node in nodes:
                if node.anchor_block is None:
                    break
                anchors.append(node.anchor_block)
        return kv_pages, anchors

    # Inserting --------------------------------------------------------------------------
    def insert(
        self,
        tokens: Any,
        salt: str | None,
        kv_pages: Sequence[int],
        anchor_blocks: Sequence[int] = (),
        state_slots: Mapping[int, int] | None = None,
    ) -> InsertResult:
        """Caches the first `len(kv_pages)` whole pages of `tokens`.

        kv_pages[i] / anchor_blocks[i] hold page i (tokens [i*P, (i+1)*P)); anchor_blocks is
        required (same length) under suffixreplay and must be empty otherwise. state_slots
        maps a page-aligned token position (0 < pos <= len(kv_pages)*P) to the checkpoint
        slot holding the states after that many tokens. Supplied ids must be held by the
        caller (from alloc_*) or be the tree's own ids for that page.
        """
        return self.admitter.insert(
            encode_tokens(tokens),
            salt,
            list(kv_pages),
            list(anchor_blocks),
            dict(state_slots or {}),
            self._tick(),
        )

    # Locking ----------------------------------------------------------------------------
    def lock(self, nodes: Sequence[PageNode]) -> None:
        """Pins a path (root child first, as in MatchResult / InsertResult.nodes)."""
        _check_path(nodes)
        for node in nodes:
            if node.lock_ref == 0 and node.on_device:
                self.evictor.num_locked_device += 1
            node.lock_ref += 1

    def unlock(self, nodes: Sequence[PageNode]) -> None:
        _check_path(nodes)
        unlocked = [n for n in nodes if n.lock_ref <= 0]
        if unlocked:
            raise ValueError(f"unlock of nodes that are not locked: {unlocked[:3]}")
        for node in nodes:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.on_device:
                    self.evictor.num_locked_device -= 1
                if node.num_device_children == 0:
                    self.evictor.push_leaf(node)
                if node.state_slot is not None:
                    self.evictor.push_state(node)

    # Retention --------------------------------------------------------------------------
    def retain(self, nodes: Sequence[PageNode], priorities: Sequence[PagePriority]) -> int:
        """Gives a path's pages the retention priorities a request asked for (at most one
        per node, root child first); see `backend/cache/retention.py`."""
        _check_path(nodes)
        return self.evictor.retain(nodes, priorities)

    # Eviction ---------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Evicts up to `num_pages` unlocked device leaves; returns how many went."""
        return self.evictor.evict_pages(num_pages, EXPLICIT)

    @property
    def num_idle_device_pages(self) -> int:
        """Device pages in the tree that no running request holds."""
        in_tree = self.kv_pool.num_used - len(self.kv.ids)
        return in_tree - self.evictor.num_locked_device

    def trim(self) -> int:
        """Evicts LRU leaves down to `max_cached_pages` idle device pages (demoted to the
        lower tiers where there are any); returns how many went."""
        cap = self.config.max_cached_pages
        if cap is None:
            return 0
        excess = self.num_idle_device_pages - cap
        return self.evictor.evict_pages(excess, CAPACITY) if excess > 0 else 0

    def reset(self, salt: str | None = None, every_salt: bool = True) -> tuple[int, int]:
        """Forgets the cached prefixes of namespace `salt` (every namespace with
        `every_salt`) on every tier; pages a running request holds stay (with their
        copies and states). Returns (pages removed, pages kept because held)."""
        roots = list(self.tree.roots.values()) if every_salt else \
            [r for r in [self.tree.root(salt)] if r is not None]
        removed = kept = 0
        for root in roots:
            r, k = self.evictor.drop_unlocked(root)
            removed, kept = removed + r, kept + k
        self.tier.on_reset(None if every_salt else normalize_salt(salt))
        return removed, kept

    def evict_checkpoints(self, num_slots: int) -> int:
        """Drops up to `num_slots` checkpoints (LRU; their KV pages stay)."""
        return self.evictor.evict_states(num_slots, EXPLICIT)

    def shadow_states(self, nodes: Sequence[PageNode]) -> int:
        """Suffix replay (with `shadowed_states_first`): the live states on the path `nodes`
        (root child first) go first when slots run out, unless several lookups resumed from
        them (`Evictor.shadow_states`); returns how many were shadowed. The engine calls it
        for the path a request resumed from once the request saved a deeper state: any
        prefix can be rebuilt by a replay, so a state is a shortcut, and a continuation of
        that path needs the deeper one (a chat turn resumes from the previous turn's prompt
        end, never again from the one before). Without it, sessions taking turns cycle
        through an LRU of states: each turn keeps two or three and the one a session's next
        turn needs is the first to go."""
        if self.config.policy != "suffixreplay" or not self.config.shadowed_states_first:
            return 0
        _check_path(nodes)
        return self.evictor.shadow_states(nodes)

    def resumed_from(self, node: PageNode) -> None:
        """A request loaded `node`'s state (the deepest of its match): counted, and a
        shadowed state that requests keep resuming from is a branch point, recent again."""
        self.evictor.resumed_from(node)

    # Allocation -------------------------------------------------------------------------
    def alloc_pages(
        self, num_pages: int, with_anchors: bool | None = None
    ) -> PageAllocation | None:
        """Ids for `num_pages` new pages, evicting LRU leaves if the pools are short.

        Returns None (allocating nothing; evictions already done stay done) when not enough
        can be evicted, e.g. everything is locked: the caller waits and retries.
        """
        with_anchors = self.uses_anchors if with_anchors is None else with_anchors
        pools = [self.kv_pool] + ([self.anchor_pool] if with_anchors else [])
        for pool in pools:
            if num_pages > pool.capacity:
                raise ValueError(
                    f"{num_pages} pages asked, the {pool.name} pool holds {pool.capacity}"
                )
        while (short := max(num_pages - p.num_free for p in pools)) > 0:
            if self.evictor.evict_pages(short, CAPACITY) == 0:
                return None
        kv = self.kv.alloc(num_pages)
        anchors = self.anchors.alloc(num_pages) if with_anchors else []
        return PageAllocation(kv, anchors)

    def alloc_state_slots(self, num_slots: int) -> list[int] | None:
        """Checkpoint slots, evicting LRU checkpoints; None if impossible (all held by
        requests, or more than the pool holds: `num_checkpoint_slots=0` keeps no states)."""
        if num_slots > self.state_pool.capacity:
            return None
        short = num_slots - self.state_pool.num_free
        if short > 0 and self.evictor.evict_states(short, CAPACITY) < short:
            return None
        return self.states.alloc(num_slots)

    def free_pages(self, kv_pages: Iterable[int], anchor_blocks: Iterable[int] = ()) -> None:
        """Returns caller-held ids (e.g. InsertResult duplicates, an aborted request's pages)."""
        kv_pages, anchor_blocks = list(kv_pages), list(anchor_blocks)
        self.kv.check(kv_pages)  # both checked before either is freed
        self.anchors.check(anchor_blocks)
        self.kv.free(kv_pages)
        self.anchors.free(anchor_blocks)
        self.tier.on_free(kv_pages, anchor_blocks)

    def free_state_slots(self, slots: Iterable[int]) -> None:
        self.states.free(slots)

    # Tiers ------------------------------------------------------------------------------
    def promote(self, nodes: Sequence[PageNode]) -> bool:
        """Brings the locked path `nodes` onto the device (top-down); False if the device
        pools cannot make room (the pages promoted so far stay)."""
        _check_path(nodes)
        if any(n.lock_ref == 0 for n in nodes):
            raise ValueError("promote needs a locked path, or eviction could take its parents")
        for node in nodes:
            if node.on_device:
                continue
            want_anchor = self.uses_anchors and node.anchor_location != Tier.DEVICE
            alloc = self.alloc_pages(1, with_anchors=want_anchor)
            if alloc is None:
                return False
            anchor = alloc.anchor_blocks[0] if want_anchor else None
            try:
                self.tier.on_promote(node, alloc.kv_pages[0], anchor)
            except BaseException:
                self.free_pages(alloc.kv_pages, alloc.anchor_blocks)
                raise
            self.admitter.adopt_kv(node, alloc.kv_pages[0], [])
            if anchor is not None:
                self.admitter.adopt_anchor(node, anchor, [])
            self.stats.pages_promoted += 1
        return True

    def drop_subtree(self, node: PageNode) -> int:
        """Removes an unlocked node that lives only on lower tiers, with its descendants
        (all off the device too, R2); for tier backends. Returns the pages removed."""
        if node.on_device or node.lock_ref:
            raise ValueError(f"only an unlocked off-device node can be dropped, got {node!r}")
        before = self.tree.num_nodes
        self.evictor.remove_subtree(node)
        return before - self.tree.num_nodes

    # Look-ahead -------------------------------------------------------------------------
    def protect(self, waiting: Iterable[tuple[Any, str | None]]) -> int:
        """Raises the priority of every cached page needed by the first W waiting requests
        (`(tokens, salt)` pairs, queue order); replaces the previous protection. Returns the
        number of protected pages."""
        epoch = self.policy.new_epoch()
        num_protected = 0
        for i, (tokens, salt) in enumerate(waiting):
            if i >= self.policy.window:
                break
            self.tier.on_lookup(salt)
            for node in self.tree.walk(encode_tokens(tokens), salt):
                if node.protect_epoch != epoch:
                    node.protect_epoch = epoch
                    num_protected += 1
        return num_protected

    # Introspection ----------------------------------------------------------------------
    def checkpoint_positions(self, prompt_len: int, start: int = 0,
                             branch_point: int | None = None) -> list[int]:
        """Where a prefill from `start` must capture states (empty unless checkpoint policy);
        `branch_point` matters to the "sglang" placement only."""
        if self.config.policy != "checkpoint":
            return []
        if self.config.checkpoint_placement == "sglang":
            return sglang_positions(prompt_len, start, self.config.checkpoint_prefill_chunk,
                                    self.page_size, branch_point)
        return checkpoint_positions(
            prompt_len, start, self.config.checkpoint_interval, self.page_size
        )

    def evictable_leaves(self) -> list[PageNode]:
        """Current eviction candidates, in eviction order (O(N); for tests and debugging)."""
        self.evictor.expire()
        leaves = [n for n in self.tree.iter_nodes() if is_evictable_leaf(n)]
        return sorted(leaves, key=lambda n: (self.policy.is_protected(n), n.priority,
                                             n.last_access))

    @property
    def num_cached_pages(self) -> int:
        return self.tree.num_nodes

    def assert_invariants(self) -> None:
        from backend.cache.invariants import check_store

        check_store(self)


def _check_path(nodes: Sequence[PageNode]) -> None:
    """A chain from a root's child down; the deepest node alive (then all are: only leaves
    are ever removed)."""
    if not nodes:
        return
    first = nodes[0]
    if first.parent is None or first.parent.parent is not None:
        raise ValueError(f"nodes[0]={first!r} is not a child of a root")
    for i in range(1, len(nodes)):
        if nodes[i].parent is not nodes[i - 1]:
            raise ValueError(f"nodes[{i}] is not a child of nodes[{i - 1}]")
    if not nodes[-1].alive:
        raise ValueError(f"{nodes[-1]!r} was evicted")
