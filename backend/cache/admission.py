"""Admission of new pages into the prefix store: validate what the caller supplies, extend the
tree at page boundaries, adopt the caller's ids (KV page, anchor block, checkpoint slot) or
report them as duplicates when the tree already holds that page or state.

KV and anchors of a page are admitted together (invariant R4): a new node gets both under
suffixreplay. Walking top-down keeps device residency top-closed (R2): every node on the
inserted path ends on the device.
"""

from __future__ import annotations

from backend.cache.base import InsertResult, Tier
from backend.cache.config import CacheConfig
from backend.cache.eviction import Evictor
from backend.cache.pools import HeldIds
from backend.cache.radix import TOKEN_BYTES, PageNode, RadixTree
from backend.cache.stats import CacheStats


class Admitter:
    """Inserts pages for one store (shares its tree, held ids, evictor and stats)."""

    def __init__(
        self,
        config: CacheConfig,
        tree: RadixTree,
        held: tuple[HeldIds, HeldIds, HeldIds],
        evictor: Evictor,
        stats: CacheStats,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.uses_anchors = config.uses_anchors
        self.tree = tree
        self.kv, self.anchors, self.states = held
        self.evictor = evictor
        self.stats = stats

    def insert(
        self,
        key: bytes,
        salt: str | None,
        kv_pages: list[int],
        anchors: list[int],
        states: dict[int, int],
        tick: int,
    ) -> InsertResult:
        """See `PrefixStore.insert`; `key` is the encoded tokens, `tick` the access stamp."""
        self.evictor.tier.on_lookup(salt)
        existing = self._validate(key, salt, kv_pages, anchors, states)
        if self.config.policy == "none":
            return InsertResult(0, [], kv_pages, anchors, list(states.values()))
        if not kv_pages:
            return InsertResult(0, [], [], [], [])
        parent = self.tree.root(salt, create=True)
        path: list[PageNode] = []
        admitted: list[PageNode] = []
        dup_kv: list[int] = []
        dup_anchor: list[int] = []
        size = self.tree.page_bytes
        for i in range(len(kv_pages)):
            if i < len(existing):
                node = existing[i]
            else:
                node = self.tree.add_child(parent, key[i * size : (i + 1) * size])
            if self.adopt_kv(node, kv_pages[i], dup_kv):
                admitted.append(node)
            if self.uses_anchors:
                self.adopt_anchor(node, anchors[i], dup_anchor)
            node.last_access = tick
            path.append(node)
            parent = node
        dup_state = self._adopt_states(path, states, tick)
        self.evictor.push_leaf(path[-1])
        num_new = len(path) - len(existing)
        self.stats.pages_inserted += num_new
        if admitted:
            self.evictor.tier.on_insert(admitted)
        return InsertResult(num_new, path, dup_kv, dup_anchor, dup_state)

    def _validate(
        self,
        key: bytes,
        salt: str | None,
        kv_pages: list[int],
        anchors: list[int],
        states: dict[int, int],
    ) -> list[PageNode]:
        """Checks the arguments before anything changes; returns the existing path."""
        size, num_pages = self.page_size, len(kv_pages)
        num_tokens = len(key) // TOKEN_BYTES
        if num_pages > num_tokens // size:
            raise ValueError(f"{num_pages} KV pages for {num_tokens} tokens (page_size={size})")
        if self.uses_anchors and len(anchors) != num_pages:
            raise ValueError(f"{len(anchors)} anchor blocks for {num_pages} KV pages")
        if not self.uses_anchors and anchors:
            raise ValueError(f"policy {self.config.policy!r} stores no anchors, got {anchors}")
        for pos in states:
            if pos <= 0 or pos % size or pos > num_pages * size:
                raise ValueError(
                    f"state position {pos} is not a page boundary in (0, {num_pages * size}]"
                )
        existing = self.tree.walk(key[: num_pages * self.tree.page_bytes], salt)
        self.kv.check(kv_pages, [n.kv_page for n in existing])
        self.anchors.check(anchors, [n.anchor_block for n in existing])
        positions = sorted(states)
        owned = {(i + 1) * size: n.state_slot for i, n in enumerate(existing)}
        self.states.check([states[p] for p in positions], [owned.get(p) for p in positions])
        return existing

    def adopt_kv(self, node: PageNode, page: int, duplicates: list[int]) -> bool:
        """Gives `node` the caller's KV page unless it has one; True if adopted."""
        if node.kv_page == page:
            return False
        if node.kv_page is not None:
            duplicates.append(page)
            return False
        # A new node, or a demoted one whose KV the caller just recomputed or promoted.
        self.kv.adopt(page)
        node.kv_page = page
        node.kv_location = Tier.DEVICE
        node.parent.num_device_children += 1
        if node.lock_ref:  # promoted (or recomputed) under a running request's lock
            self.evictor.num_locked_device += 1
        return True

    def adopt_anchor(self, node: PageNode, block: int, duplicates: list[int]) -> None:
        if node.anchor_block == block:
            return
        if node.anchor_block is not None:
            duplicates.append(block)
            return
        self.anchors.adopt(block)
        node.anchor_block = block
        node.anchor_location = Tier.DEVICE

    def _adopt_states(self, path: list[PageNode], states: dict[int, int], tick: int) -> list[int]:
        duplicates: list[int] = []
        for pos, slot in sorted(states.items()):
            node = path[pos // self.page_size - 1]
            if node.state_slot == slot:
                continue
            if node.state_slot is not None:
                duplicates.append(slot)
                continue
            self.states.adopt(slot)
            node.state_slot = slot
            node.state_access, node.state_uses, node.state_shadowed = tick, 0, False
            self.evictor.push_state(node)
            self.stats.checkpoints_inserted += 1
        return duplicates
