"""`TierSpace`: making room in the DRAM pool and in the SSD byte budget for `TieredBackend`.

DRAM victims, oldest first, look-ahead-protected ones last, never one in use (a read filling
it, a write reading it, a pin): a copy also held on the device or SSD is just released; one
that is not is written to SSD first (foreground priority, waited for), or, with no SSD room,
dropped from the tree if it is an unlocked leaf.
SSD victims, oldest first, protected last, none in use: the chunk of a page also held on the
device or in DRAM is deleted; an SSD-only unlocked leaf is dropped from the tree. Chunks
found at start-up in a namespace no request has asked for yet go when nothing else can.
"""

from __future__ import annotations

from backend.cache.io_pool import Priority
from backend.cache.retention import DEFAULT_PRIORITY
from backend.cache.tier_entry import TierEntry


class TierSpace:
    """Room-making for the DRAM slots and the SSD budget (mixed into `TieredBackend`)."""

    def alloc_host(self, may_wait: bool = True) -> int | None:
        """A free DRAM slot, releasing LRU copies if needed; None if none can go.
        may_wait=False never waits for the disk (no synchronous write of a victim)."""
        slot = self.host.alloc()
        tried: set[TierEntry] = set()
        while slot is None:
            e = self._pick_host_victim(tried, may_wait)
            if e is None:
                return None
            tried.add(e)
            if self._release_host_copy(e, may_wait):
                slot = self.host.alloc()
        return slot

    def queue_writeback(self, e: TierEntry, ready=None, priority=Priority.WRITEBACK) -> bool:
        """Queues the entry's DRAM copy for SSD (budget permitting); True if queued."""
        if self.ssd is None or e.chunk is not None or e.write is not None or not e.host_ready:
            return False
        self.ssd_room()
        if not self.ssd.can_write():  # counts and warns once
            return False
        self.submit_write(e, ready, priority)
        return True

    def ssd_room(self) -> bool:
        """Frees budget for one more chunk; False if it cannot (nothing is counted)."""
        if self.ssd is None or self.ssd.disk_full:
            return False
        tried: set[TierEntry] = set()
        while self.ssd.room_short() > 0:
            e = self._pick_ssd_victim(tried)
            if e is not None:
                tried.add(e)
                self._release_chunk(e)
            elif not self._delete_unrestored():
                return False
        return True

    def protected(self, node) -> bool:
        """Whether `node`'s copies go last: the look-ahead window needs it, or its retention
        priority is above the default (`backend/cache/retention.py`)."""
        store = self.store
        return store is not None and (store.policy.is_protected(node)
                                      or store.evictor.priority_of(node) > DEFAULT_PRIORITY)

    # DRAM -------------------------------------------------------------------------------
    def _pick_host_victim(self, tried: set[TierEntry], may_wait: bool) -> TierEntry | None:
        fallback = None
        may_write = may_wait and self.ssd is not None and not self.ssd.disk_full
        for e in self.host_lru:
            if e in tried or not e.host_ready or not e.idle:
                continue
            node = e.node
            if not (node.on_device or self.chunk_ready(e) or may_write or self._droppable(e)):
                continue
            if self.protected(node):
                fallback = fallback or e
                continue
            return e
        return fallback

    def _release_host_copy(self, e: TierEntry, may_wait: bool) -> bool:
        if may_wait and not (e.node.on_device or self.chunk_ready(e)):
            if self.queue_writeback(e, None, Priority.FOREGROUND):
                self.wait_op(e.write)
                if self.chunk_ready(e):
                    self.stats.ssd_demotions += 1
        if e.node.on_device or self.chunk_ready(e):
            self.free_host(e)
            self.sync_location(e)
            self.stats.host_evictions += 1
            return True
        if self._droppable(e):
            self.stats.pages_dropped += self.store.drop_subtree(e.node)
            return True
        return False

    def _droppable(self, e: TierEntry) -> bool:
        """An off-device, unlocked, idle leaf: dropping it strands nothing."""
        node = e.node
        return (
            not node.on_device
            and node.lock_ref == 0
            and not node.children
            and e.idle
            and self.store is not None
        )

    # SSD --------------------------------------------------------------------------------
    def _pick_ssd_victim(self, tried: set[TierEntry]) -> TierEntry | None:
        fallback = None
        for e in self.ssd_lru:
            if e in tried or not e.idle:
                continue
            node = e.node
            elsewhere = node.on_device or e.host_ready
            if not elsewhere and (e.host_slot is not None or not self._droppable(e)):
                continue
            if self.protected(node):
                fallback = fallback or e
                continue
            return e
        return fallback

    def _release_chunk(self, e: TierEntry) -> None:
        self.stats.ssd_budget_evictions += 1
        if e.node.on_device or e.host_ready:
            chunk, e.chunk = e.chunk, None
            self.ssd_lru.pop(e, None)
            self.delete_chunk(chunk)
        else:
            self.stats.pages_dropped += self.store.drop_subtree(e.node)

    def _delete_unrestored(self) -> bool:
        """Deletes the oldest chunk of a namespace not restored yet; False if none is left."""
        oldest = None
        for salt_hash, items in self.pending_restore.items():
            for i, (chunk, _) in enumerate(items):
                if oldest is None or chunk.seq < oldest[2].seq:
                    oldest = (salt_hash, i, chunk)
        if oldest is None:
            return False
        salt_hash, i, chunk = oldest
        items = self.pending_restore[salt_hash]
        items.pop(i)
        if not items:
            del self.pending_restore[salt_hash]
        self.stats.ssd_budget_evictions += 1
        self.delete_chunk(chunk)
        return True
