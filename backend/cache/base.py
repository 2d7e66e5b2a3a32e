"""Results and interfaces of the prefix store: what a match returns, what an insert adopts,
and the tier interface that decides what eviction from the device does.

The cache deals in ids (KV page ids, anchor block ids, checkpoint slot ids); the engine owns
the tensors those ids index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from backend.cache.radix import PageNode
    from backend.cache.store import PrefixStore


class Tier(IntEnum):
    """Where a page's KV (or its anchor block) lives; lower value = faster tier."""

    DEVICE = 0
    HOST = 1
    SSD = 2


class EvictAction(IntEnum):
    DROP = 0  # the page leaves the cache everywhere
    DEMOTE = 1  # the page leaves the device but stays in the tree on a lower tier


class EvictDecision(NamedTuple):
    """A tier backend's answer to "this page must leave the device".

    For DEMOTE, `kv_location` / `anchor_location` name the tiers now holding the copies.
    """

    action: EvictAction
    kv_location: Tier | None = None
    anchor_location: Tier | None = None


class StateCheckpoint(NamedTuple):
    """A resident state (all linear layers) at the end of `node`'s page: `num_tokens` tokens."""

    node: PageNode
    slot: int
    num_tokens: int


class MatchResult(NamedTuple):
    """Longest usable page-aligned cached prefix of a request.

    nodes: matched pages, root child first (P = num_matched_pages entries).
    kv_pages / anchor_blocks: device ids of the leading pages that are on the device, in
        order. Device residency is top-closed (a device page's parent is on the device), so
        these cover `nodes[:len(kv_pages)]`; a shorter list means the tail sits on a lower
        tier and must be promoted (`PrefixStore.promote`) before use. `anchor_blocks` is empty
        unless the policy is "suffixreplay".
    checkpoint: deepest saved state on the matched path (checkpoint policy: the match ends
        there; suffixreplay: only a live state at the match end is useful) or None. Its
        `slot` is None when the state is on a lower tier (`TierBackend.load_state`).
    live_state: device slot of the state at exactly the match end, or None.
    num_cached_pages: pages found in the tree before the policy cut the match (checkpoint
        policy resumes at its checkpoint even when deeper KV pages exist).
    """

    num_matched_pages: int
    num_matched_tokens: int
    nodes: list[PageNode]
    kv_pages: list[int]
    anchor_blocks: list[int]
    checkpoint: StateCheckpoint | None
    live_state: int | None
    num_cached_pages: int


class InsertResult(NamedTuple):
    """What `insert` did with the ids the caller supplied.

    nodes: the full path of the inserted pages (root child first), ready for `lock`.
    num_new_pages: pages that were not in the tree before.
    duplicate_*: supplied ids the tree did not adopt because it already holds that page (or
        that state); they stay with the caller, who must point its page table at
        `nodes[i].kv_page` and then free them. Supplied ids equal to the tree's own ids are
        neither adopted nor duplicate.
    """

    num_new_pages: int
    nodes: list[PageNode]
    duplicate_kv_pages: list[int]
    duplicate_anchor_blocks: list[int]
    duplicate_state_slots: list[int]


class PageAllocation(NamedTuple):
    """Ids for `num_pages` new pages: KV pages and (suffixreplay) the matching anchor blocks."""

    kv_pages: list[int]
    anchor_blocks: list[int]


class TierBackend(ABC):
    """Lower storage tiers behind the device pools (DRAM, SSD).

    Contract: the store calls `on_evict` for an unlocked device leaf that must leave the
    device, while the node still holds its device ids (copy them out before returning
    DEMOTE). The store then frees the device ids. `on_remove` is called when a node leaves the
    tree for good (release lower-tier copies). `on_promote` is called after the store has
    allocated fresh device ids for a node living on a lower tier (copy the data in).
    `on_insert` sees newly admitted pages (write-back to SSD hooks here). A backend may
    drop an unlocked off-device node through `PrefixStore.drop_subtree` (its lower tier is
    full, or its only copy turned out corrupt); it must never drop a locked one.
    """

    @abstractmethod
    def on_evict(self, node: PageNode) -> EvictDecision: ...

    def attach(self, store: PrefixStore) -> None:  # noqa: B027 - optional hook
        """Called once by the store that owns this backend (lower tiers that must drop or
        re-insert nodes keep the reference)."""

    def on_lookup(self, salt: str | None) -> None:  # noqa: B027 - optional hook
        """Called before the tree is searched in namespace `salt` (match, protect, insert):
        a restarted SSD tier re-inserts that namespace's pages here."""

    def on_remove(self, node: PageNode) -> None:  # noqa: B027 - optional hook
        """Node dropped from the tree: nothing to release in a single-tier store."""

    def on_reset(self, salt: str | None) -> None:  # noqa: B027 - optional hook
        """A prefix cache reset of namespace `salt` (None: every namespace), after the store
        removed its unlocked nodes: a backend forgets what it holds outside the tree (pages
        an earlier run left on SSD and not yet restored)."""

    def on_promote(self, node: PageNode, kv_page: int, anchor_block: int | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} holds no lower tier to promote from")

    def on_retain(self, node: PageNode, priority: int,  # noqa: B027 - optional hook
                  duration_s: float | None) -> None:
        """A request set `node`'s retention priority (for `duration_s` more seconds; None:
        for good): a tier that outlives the process keeps it too."""

    def on_insert(self, nodes: list[PageNode]) -> None:  # noqa: B027 - optional hook
        """New pages admitted to the device: no write-back in a single-tier store."""

    def on_free(self, kv_pages: list[int], anchor_blocks: list[int]) -> None:  # noqa: B027
        """Caller-held ids returned to the pools (`PrefixStore.free_pages`): whatever the
        backend staged for those device ids is stale now."""

    def on_state_evict(self, node: PageNode, slot: int) -> None:  # noqa: B027
        """A checkpoint's device slot `slot` is about to be freed while `node` stays in the
        tree: a backend that tiers states copies it out here."""

    def has_state(self, node: PageNode) -> bool:
        """Whether a lower tier holds `node`'s checkpoint state."""
        return False

    def load_state(self, node: PageNode, dst, dst_slot: int) -> bool:
        """Copies `node`'s lower-tier state into slot `dst_slot` of the StateSlots `dst`;
        False (a miss) when no verified copy can be had."""
        return False


class DropTier(TierBackend):
    """Single tier: a page evicted from the device leaves the cache."""

    def on_evict(self, node: PageNode) -> EvictDecision:
        return EvictDecision(EvictAction.DROP)
