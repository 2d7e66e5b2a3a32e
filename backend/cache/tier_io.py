"""`TierIO`: the engine-thread side of SSD operations for `TieredBackend`: submit reads,
write-backs and deletes, and apply their completions (reaping) to the entries.

I/O threads only complete futures; a done-callback queues the op and the engine thread
applies it at its next call (`reap`) or right after waiting for it (`wait_op`). So every
change to entries, LRUs, budget and stats happens on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from backend.cache.base import Tier
from backend.cache.chunk_format import ChunkHeader, Expected, prefix_hash, salt_hash
from backend.cache.host_pool import HostPool
from backend.cache.io_pool import Priority
from backend.cache.page_io import CopyStream
from backend.cache.radix import lora_of
from backend.cache.ssd import ChunkState, SsdChunk, SsdStore
from backend.cache.tier_entry import Op, OpKind, TierEntry
from backend.cache.tier_stats import TierStats


class TierIO:
    """State shared by the tier backend: DRAM pool, SSD store, entries, ops in flight."""

    host: HostPool
    ssd: SsdStore | None
    stats: TierStats
    copies: CopyStream
    fingerprint: bytes
    uses_anchors: bool

    def _init_io(self) -> None:
        self.host_lru: OrderedDict[TierEntry, None] = OrderedDict()  # entries with a slot
        self.ssd_lru: OrderedDict[TierEntry, None] = OrderedDict()  # entries with a READY chunk
        self.by_hash: dict[bytes, TierEntry] = {}
        self.zombies: set[TierEntry] = set()  # dropped from the tree, resources still busy
        self.inflight: dict[int, Op] = {}
        self._done: deque[Op] = deque()
        self._salt_hashes: dict[str, bytes] = {}
        # LoRA adapter name -> a digest of its weights: an adapter's namespace hashes with it,
        # so pages an earlier run left on SSD under another adapter of that name are foreign.
        self.adapter_fingerprints: dict[str, str] = {}

    # Entries ----------------------------------------------------------------------------
    def salt_hash(self, salt: str) -> bytes:
        h = self._salt_hashes.get(salt)
        if h is None:
            adapter = lora_of(salt)
            key = salt if adapter is None else \
                f"{salt}@{self.adapter_fingerprints.get(adapter, '')}"
            h = self._salt_hashes[salt] = salt_hash(key)
        return h

    def add_adapter(self, name: str, fingerprint: str) -> None:
        """A LoRA adapter the engine serves as `name` (before any request names it)."""
        self.adapter_fingerprints[name] = fingerprint
        self._salt_hashes.clear()

    def entry(self, node) -> TierEntry:
        """The node's entry, created (with those of its ancestors) on first use."""
        if node.tier_data is not None:
            return node.tier_data
        missing = []
        while node.parent is not None and node.tier_data is None:
            missing.append(node)
            node = node.parent
        for n in reversed(missing):
            parent = n.parent.tier_data.prefix_hash if n.parent.parent else self.salt_hash(n.salt)
            e = TierEntry(n, prefix_hash(parent, n.key), parent)
            n.tier_data = e
            self.by_hash[e.prefix_hash] = e
        return missing[0].tier_data

    def expected(self, e: TierEntry) -> Expected:
        lay = self.host.layout
        return Expected(self.fingerprint, self.salt_hash(e.node.salt), e.prefix_hash,
                        e.node.key, lay.describe(), lay.kv_bytes, lay.anchor_bytes)  # fmt: skip

    def chunk_ready(self, e: TierEntry) -> bool:
        return e.chunk is not None and e.chunk.state == ChunkState.READY

    def sync_location(self, e: TierEntry) -> None:
        """An off-device node's location is its fastest verified copy."""
        node = e.node
        if e.dead or node.on_device or e.lost:
            return
        loc = Tier.HOST if e.host_ready else Tier.SSD if self.chunk_ready(e) else None
        node.kv_location = loc
        node.anchor_location = loc if self.uses_anchors else None

    def touch_host(self, e: TierEntry) -> None:
        self.host_lru[e] = None
        self.host_lru.move_to_end(e)

    def free_host(self, e: TierEntry) -> None:
        slot, e.host_slot = e.host_slot, None
        e.host_ready = e.prefetched = False
        self.host_lru.pop(e, None)
        self.copies.fence()  # no asynchronous copy may still read or fill the slot
        self.host.free(slot)

    # Submitting -------------------------------------------------------------------------
    def _track(self, kind: OpKind, e: TierEntry | None, chunk: SsdChunk, future) -> Op:
        op = Op(kind, e, chunk, future)
        self.inflight[id(op)] = op
        future.add_done_callback(lambda _f, op=op: self._done.append(op))
        return op

    def submit_write(self, e: TierEntry, ready: Callable[[], None] | None, priority) -> Op:
        """Writes the entry's DRAM copy to a new chunk (caller checked budget and state)."""
        node, lay = e.node, self.host.layout
        header = ChunkHeader(self.fingerprint, self.salt_hash(node.salt), e.prefix_hash,
                             e.parent_hash, node.depth, lay.page_size, lay.kv_bytes,
                             lay.anchor_bytes, 0, lay.describe(), node.key)  # fmt: skip
        slot = e.host_slot
        chunk, future = self.ssd.submit_write(
            header, self.host.payload(slot), self.host.io_buffers(slot), ready, priority
        )
        e.chunk = chunk
        e.write = self._track(OpKind.WRITE, e, chunk, future)
        return e.write

    def submit_read(self, e: TierEntry, slot: int, priority: Priority) -> Op:
        """Fills DRAM slot `slot` from the entry's chunk (verified before it is served)."""
        e.host_slot, e.host_ready = slot, False
        self.touch_host(e)
        future = self.ssd.submit_read(
            e.chunk, self.expected(e), self.host.payload(slot), self.host.io_buffers(slot),
            priority,
        )  # fmt: skip
        e.read = self._track(OpKind.READ, e, e.chunk, future)
        return e.read

    def delete_chunk(self, chunk: SsdChunk) -> None:
        self._track(OpKind.DELETE, None, chunk, self.ssd.submit_delete(chunk))

    # Completing -------------------------------------------------------------------------
    def reap(self) -> None:
        """Applies every completed operation (engine thread)."""
        while self._done:
            self.apply(self._done.popleft())

    def wait_op(self, op: Op) -> None:
        op.future.exception()  # waits; errors are handled by apply
        self.apply(op)

    def drain(self) -> None:
        """Waits for every SSD operation in flight and applies it (tests, shutdown)."""
        while self.inflight:
            for op in list(self.inflight.values()):
                self.wait_op(op)
            self.reap()
        self.reap()

    def apply(self, op: Op) -> None:
        if op.applied:
            return
        op.applied = True
        del self.inflight[id(op)]
        if op.kind == OpKind.DELETE:
            self.ssd.finish_delete(op.chunk, op.future)
        elif op.kind == OpKind.WRITE:
            self._apply_write(op)
        else:
            self._apply_read(op)

    def _apply_write(self, op: Op) -> None:
        e = op.entry
        e.write = None
        ok = self.ssd.finish_write(op.chunk, op.future)
        if not ok:
            e.chunk = None
        elif e.dead:
            pass  # released below with the entry
        else:
            self.ssd_lru[e] = None
            if e.node.on_device and e.host_slot is not None and e.pins == 0:
                # A staging copy of a page still on the device: the first DRAM copy to go.
                self.host_lru.move_to_end(e, last=False)
        self.release_if_idle(e)

    def _apply_read(self, op: Op) -> None:
        e = op.entry
        e.read = None
        ok = self.ssd.finish_read(op.chunk, op.future)
        if e.dead:
            self.release_if_idle(e)
        elif ok:
            e.host_ready = True
            self.sync_location(e)
        else:  # refused chunk: a miss, never served
            self.free_host(e)
            if e.chunk is op.chunk:
                e.chunk = None
                self.ssd_lru.pop(e, None)
                self.delete_chunk(op.chunk)
            self.sync_location(e)
            if not e.node.on_device and e.node.kv_location is None:
                self.on_lost(e)

    def release_if_idle(self, e: TierEntry) -> None:
        """Frees a dropped entry's DRAM slot and chunk once nothing uses them (H2, S2)."""
        if not e.dead or not e.idle:
            return
        self.zombies.discard(e)
        if e.host_slot is not None:
            self.free_host(e)
        chunk, e.chunk = e.chunk, None
        self.ssd_lru.pop(e, None)
        if chunk is not None and chunk.state == ChunkState.READY:
            self.delete_chunk(chunk)

    def on_lost(self, e: TierEntry) -> None:  # overridden by TieredBackend
        raise NotImplementedError
