"""`StateTier`: saved states below the device slots (DRAM, then SSD): the checkpoint
policy's checkpoints, or suffix replay's live states.

Under the checkpoint policy a cached page is usable only up to the deepest page that has a
saved state (every linear layer's recurrent and conv state at that page's end). KV pages
demote to DRAM and SSD through `TieredBackend`; without this tier their states would be
dropped with their device slot and a page found in DRAM or on SSD could never be resumed
from. This is what a KV-tiering system (LMCache, PCR) must also keep for a hybrid model.
Suffix replay needs no state to resume (its anchors rebuild one), but a live state that
loses its device slot spills here too, when DRAM state slots are configured: a request whose
match ends on its page loads it instead of replaying (`CacheManager.admit`; only at the
match's end, `end_only`). A live state may be a replayed one, which holds only for the
replay configuration that rebuilt it: that configuration is the files' `tag`, checked with
the layout.

Rules (all on the engine thread; I/O threads touch only files and the buffers given):
  - A checkpoint that loses its device slot (slot LRU, or its page leaves the device) is
    copied into a DRAM slot (`spill`); with an SSD tier the copy is also written to a file
    in the background (write-through, as new KV pages are).
  - DRAM full: the least recently used copy that no look-ahead protects and no I/O uses
    leaves DRAM; it stays on SSD when its file is written, else it is forgotten.
  - SSD: at most `ssd_slots` files; the least recently used file goes first.
  - A read (queue-driven prefetch, or on demand at admission) checks the header (magic,
    model fingerprint, salt, prefix hash, layout and tag) and the payload's xxh3; any
    mismatch is a miss: the copy is forgotten and the file deleted. A cache may forget,
    never serve a wrong state.
  - Files are `<ssd_path>/states/<prefix hash>.<seq>.st` in the SSD chunk format
    (`chunk_format.py`: the same header, with the state's layout in place of a page's, and
    the state as the payload), written and read through `PosixChunkIO`.
  - Warm restart: the files found at start-up (the newest per prefix hash, at most
    `ssd_slots`, newest first) wait, unread, until their node comes back: a KV page restored
    from SSD (`tier_restore.py`, lazily per namespace) adopts the state file of its prefix
    hash as its SSD copy (`adopt`; a page computed again instead does not: its file waits
    until room is needed). The header is checked when the file is read, as for any other;
    files not adopted give way first when room is needed.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import torch

from backend.cache.base import Tier
from backend.cache.chunk_format import (
    ChunkError,
    ChunkHeader,
    Expected,
    header_len_of,
    unpack_header,
)
from backend.cache.file_io import PosixChunkIO
from backend.cache.host_pool import aligned_empty, cuda_present
from backend.cache.io_pool import IOPool, Priority
from backend.cache.page_io import copy_tensor
from backend.cache.pools import PagePool
from backend.cache.tier_stats import BAD_HEADER, FOREIGN, IO_ERROR, LAYOUT

SUFFIX = ".st"
_SEGMENT_ALIGN = 64


def state_file_text(layout: StateLayout, tag: str) -> str:
    """A state file header's layout field: the state's layout, plus `tag` (what else a
    file's state must have been saved under to be served: suffix replay's replay
    configuration)."""
    return layout.text + (f" {tag}" if tag else "")


def state_file_bytes(device, tag: str, page_size: int) -> int:
    """Bytes of one state file (header and state) for the device's state slots."""
    layout = StateLayout(device)
    return header_len_of(state_file_text(layout, tag), page_size) + layout.nbytes


class StateLayout:
    """Byte layout of one saved state: per linear layer its recurrent then its conv state,
    each segment 64-byte aligned in a flat row."""

    def __init__(self, slots) -> None:  # slots: backend.model.StateSlots (device)
        self.tensors: list[torch.Tensor] = []
        self.segments: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for rec, conv in zip(slots.rec, slots.conv):
            for t in (rec, conv):
                nbytes = t[0].numel() * t.element_size()
                self.tensors.append(t)
                self.segments.append((offset, nbytes, t.dtype, tuple(t.shape[1:])))
                offset += -(-nbytes // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
        self.nbytes = offset
        self.text = "state:" + json.dumps([(o, n, str(d), list(s)) for o, n, d, s in
                                           self.segments])

    def views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of a flat uint8 row, one per segment."""
        return [row[o : o + n].view(d).view(s) for o, n, d, s in self.segments]

    def copy_out(self, slot: int, row: torch.Tensor) -> None:
        for t, view in zip(self.tensors, self.views(row)):
            copy_tensor(view, t[slot])

    def copy_in(self, row: torch.Tensor, dst, dst_slot: int) -> None:
        """row -> slot `dst_slot` of the StateSlots `dst` (same shapes as the source)."""
        targets = [t for rec, conv in zip(dst.rec, dst.conv) for t in (rec, conv)]
        for t, view in zip(targets, self.views(row)):
            copy_tensor(t[dst_slot], view)


class StateEntry:
    """Lower-tier copies of one node's state: a verified DRAM slot and/or a written file;
    `write` / `read` are I/O in flight (a write reads `host_slot`, a read fills
    `read_slot`); `dead`: its node left the tree (freed once no I/O uses it)."""

    __slots__ = ("node", "host_slot", "file", "write", "writing", "read", "read_slot",
                 "prefetched", "dead")

    def __init__(self, node) -> None:
        self.node = node
        self.host_slot: int | None = None
        self.file: str | None = None
        self.write: Future | None = None
        self.writing: str | None = None  # the file `write` creates
        self.read: Future | None = None
        self.read_slot: int | None = None
        self.prefetched = False
        self.dead = False

    @property
    def busy(self) -> bool:
        return self.write is not None or self.read is not None


class StateTier:
    """DRAM slots (`host_slots`) and SSD files (`ssd_slots`, 0: DRAM only) of saved states.

    tiers: the owning `TieredBackend` (prefix hashes, salt hashes, fingerprint, look-ahead
    protection, stats); device: the executor's saved-state `StateSlots`."""

    def __init__(self, tiers, device, host_slots: int, ssd_dir: str | Path | None,
                 ssd_slots: int, io: IOPool | None, tag: str = "",
                 end_only: bool = False) -> None:
        self.tiers, self.stats = tiers, tiers.stats
        self.device = device
        self.layout = StateLayout(device)
        self.text = state_file_text(self.layout, tag)
        self.end_only = end_only  # a request resumes only from a state at its match's end
        self.pool = PagePool(host_slots, "host state")
        self.host = aligned_empty(max(host_slots, 1) * self.layout.nbytes,
                                  cuda_present()).view(max(host_slots, 1), self.layout.nbytes)
        self.entries: dict[object, StateEntry] = {}
        self.host_lru: OrderedDict[StateEntry, None] = OrderedDict()
        self.ssd_lru: OrderedDict[StateEntry, None] = OrderedDict()
        self.inflight: list[StateEntry] = []
        self.zombies: set[StateEntry] = set()
        self.io = io
        self.ssd_slots = ssd_slots if ssd_dir is not None and io is not None else 0
        self.dir = Path(ssd_dir) / "states" if self.ssd_slots else None
        self.file_io = PosixChunkIO(o_direct=False)  # state rows are not 4 KiB-aligned
        self.header_len = header_len_of(self.text, tiers.layout.page_size)
        self.file_bytes = self.header_len + self.layout.nbytes
        self._seq = 0
        # Files found at start-up, by prefix hash: (seq, path), oldest first.
        self.found: OrderedDict[bytes, tuple[int, str]] = OrderedDict()
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"the SSD tier's state folder {self.dir} cannot be used: "
                                 f"{exc}") from None
            self._scan()

    def _scan(self) -> None:
        """Indexes the state files of an earlier run (newest per prefix hash, at most
        `ssd_slots`); deletes the rest and anything else in the folder (this model's files
        of another state layout or replay configuration too: never served), but another
        model's files (read from their headers): another engine sharing the directory may
        own them, as its page chunks (they are counted, never served)."""
        newest: dict[bytes, tuple[int, str]] = {}
        for path in self.dir.iterdir():
            parts = path.name.split(".")
            try:
                key, seq = bytes.fromhex(parts[0]), int(parts[1])
                ok = len(parts) == 3 and "." + parts[2] == SUFFIX
            except (ValueError, IndexError):
                ok = False
            if ok:
                reason = self._scanned_header(str(path), key)
                if reason is not None:
                    self.stats.chunk_rejects[f"state_{reason}"] += 1
                if reason == FOREIGN:
                    continue  # another model's: left alone
                ok = reason is None  # (this model's under another layout or replay: stale)
            if not ok:  # a torn temporary file, a bad header or a stranger
                path.unlink(missing_ok=True)
                continue
            old = newest.get(key)
            if old is not None:
                _unlink(old[1] if old[0] < seq else str(path))
            if old is None or old[0] < seq:
                newest[key] = (seq, str(path))
        kept = sorted(newest.items(), key=lambda kv: kv[1][0])
        for _, (_, path) in kept[:max(len(kept) - self.ssd_slots, 0)]:
            _unlink(path)
        self.found = OrderedDict(kept[max(len(kept) - self.ssd_slots, 0):])
        self._seq = max((seq for seq, _ in newest.values()), default=0)
        self.stats.restored_state_files += len(self.found)

    def _scanned_header(self, path: str, key: bytes) -> str | None:
        """Why a state file found at start-up is not this engine's to index (FOREIGN:
        another model's; LAYOUT: another state layout or replay configuration; else damaged),
        None where it is. Its payload is checked when it is read."""
        try:
            data, size = self.file_io.read_head(path, self.header_len)
            h = unpack_header(data)
        except (ChunkError, ValueError, OSError) as exc:
            return exc.reason if isinstance(exc, ChunkError) else BAD_HEADER
        if h.fingerprint != self.tiers.fingerprint:
            return FOREIGN
        if h.layout != self.text or h.kv_len != self.layout.nbytes:
            return LAYOUT
        if h.prefix_hash != key or h.header_len != self.header_len or size != self.file_bytes:
            return BAD_HEADER
        return None

    def adopt(self, node, prefix_hash: bytes) -> bool:
        """A node back in the tree (restored from SSD) takes the state
        file an earlier run left for its prefix hash as its SSD copy."""
        found = self.found.pop(prefix_hash, None)
        if found is None:
            return False
        e = self.entries.get(node)
        if e is not None and (e.file is not None or e.writing is not None):
            _unlink(found[1])  # it has its own copy (or one on the way)
            return False
        if e is None:
            e = self.entries[node] = StateEntry(node)
        e.file = found[1]
        self.ssd_lru[e] = None
        self.ssd_lru.move_to_end(e, last=False)  # written in an earlier run: least recent
        return True

    def forget_found(self) -> None:
        """Deletes the state files of an earlier run that no node adopted yet."""
        found, self.found = self.found, OrderedDict()
        for _, path in found.values():
            _unlink(path)

    # Queries ----------------------------------------------------------------------------
    def has(self, node) -> bool:
        e = self.entries.get(node)
        return e is not None and (e.host_slot is not None or e.file is not None)

    def location(self, node) -> Tier | None:
        e = self.entries.get(node)
        if e is None:
            return None
        if e.host_slot is not None:
            return Tier.HOST
        return Tier.SSD if e.file is not None else None

    # Spill ------------------------------------------------------------------------------
    def spill(self, node, device_slot: int) -> None:
        """Keeps the state in device slot `device_slot` (about to be freed) for `node`."""
        self.reap()
        e = self.entries.get(node)
        if e is not None and e.host_slot is not None:
            self.host_lru.move_to_end(e)  # same prefix, same state: the copy stands
            return
        slot = self._alloc_host()
        if slot is None:
            self.stats.state_spills_skipped += 1  # (a file, if any, still holds it)
            return
        self.layout.copy_out(device_slot, self.host[slot])  # synchronous, also on CUDA
        if e is None:
            e = self.entries[node] = StateEntry(node)
        e.host_slot = slot
        self.host_lru[e] = None
        self.stats.state_spills += 1
        if self.dir is not None and e.file is None:
            self._write(e)

    # Load -------------------------------------------------------------------------------
    def load(self, node, dst, dst_slot: int) -> bool:
        """Copies `node`'s state into slot `dst_slot` of the StateSlots `dst`; False (a miss)
        when no verified copy can be had."""
        self.reap()
        e = self.entries.get(node)
        if e is None:
            return False
        from_ssd = e.host_slot is None
        if e.host_slot is None and e.read is None and e.file is not None:
            self._read(e, Priority.FOREGROUND)
            self.stats.state_prefetch_misses += 1
        elif e.read is not None and e.prefetched:
            self.stats.state_prefetch_late += 1
        if e.read is not None:
            start = time.perf_counter()
            e.read.exception()  # waits; the outcome is applied below
            self.stats.prefetch_wait_seconds += time.perf_counter() - start
            self.reap()
        if e.dead or e.host_slot is None:
            if e.file is None or e.dead:
                return False
            return self._load_unstaged(e, dst, dst_slot)
        self.stats.state_prefetch_hits += e.prefetched
        e.prefetched = False
        self.layout.copy_in(self.host[e.host_slot], dst, dst_slot)
        self.host_lru.move_to_end(e)
        if e.file is not None:
            self.ssd_lru.move_to_end(e)
        if from_ssd:  # read now (not prefetched in time)
            self.stats.state_loads_ssd += 1
        else:
            self.stats.state_loads_host += 1
        return True

    def _load_unstaged(self, e: StateEntry, dst, dst_slot: int) -> bool:
        """No DRAM slot could be had: read the file into a temporary row."""
        row = aligned_empty(self.layout.nbytes)
        outcome = self._read_file(e.file, self._expected(e), row)
        if outcome is not None:
            self._reject(e, outcome)
            return False
        self.layout.copy_in(row, dst, dst_slot)
        self.ssd_lru.move_to_end(e)
        self.stats.state_loads_ssd += 1
        return True

    # Prefetch ---------------------------------------------------------------------------
    def _candidates(self, nodes):
        """The nodes whose state a request matching `nodes` may resume from, deepest first."""
        return nodes[-1:] if self.end_only else reversed(nodes)

    def prefetch(self, nodes) -> int:
        """Starts reading the deepest state among `nodes` (a waiting request's matched
        path; `end_only`: the last node's) that is only on SSD; returns the reads started
        (0 or 1)."""
        self.reap()
        for node in self._candidates(nodes):
            e = self.entries.get(node)
            if node.state_slot is not None or (e is not None and e.host_slot is not None):
                return 0  # the deepest state is on the device or in DRAM already
            if e is None or e.file is None:
                continue
            if e.read is not None:
                return 0
            if self._read(e, Priority.PREFETCH, take_protected=False):
                e.prefetched = True
                self.stats.state_prefetch_started += 1
                return 1
            return 0
        return 0

    def pending_read(self, nodes) -> Future | None:
        """The read of the state a request matching `nodes` would resume from (the deepest
        one) while it is in flight, starting it if it is only on SSD; None when that state
        needs no read (on the device, in DRAM, or none)."""
        self.prefetch(nodes)
        for node in self._candidates(nodes):
            e = self.entries.get(node)
            if node.state_slot is not None or (e is not None and e.host_slot is not None):
                return None
            if e is not None and e.file is not None:
                return e.read
        return None

    # Removal ----------------------------------------------------------------------------
    def remove(self, node) -> None:
        e = self.entries.pop(node, None)
        if e is None:
            return
        e.dead = True
        self.host_lru.pop(e, None)
        self.ssd_lru.pop(e, None)
        if e.busy:
            self.zombies.add(e)
        else:
            self._release(e)

    def _release(self, e: StateEntry) -> None:
        if e.host_slot is not None:
            self.pool.free([e.host_slot])
            e.host_slot = None
        if e.file is not None:
            self._delete(e.file)
            e.file = None

    # DRAM space -------------------------------------------------------------------------
    def _alloc_host(self, take_protected: bool = True) -> int | None:
        """A DRAM slot, releasing the LRU copy no I/O uses (look-ahead-protected copies
        last, and never for a prefetch: `take_protected=False`). A spill (several may come
        in one step) waits for the oldest copy's SSD write rather than lose the state."""
        if self.pool.capacity == 0:
            return None
        if self.pool.num_free == 0:
            victim = self._host_victim(take_protected)
            if victim is None and take_protected:
                writing = next((e for e in self.host_lru if e.write is not None
                                and e.read is None), None)
                if writing is not None:
                    writing.write.exception()  # waits (one state's write); applied by reap
                    self.reap()
                    victim = self._host_victim(take_protected)
            if victim is None:
                return None
            self._drop_host(victim)
        return self.pool.alloc(1)[0]

    def _host_victim(self, take_protected: bool) -> StateEntry | None:
        fallback = None
        for e in self.host_lru:  # least recently used first
            if e.busy:
                continue
            if not self.tiers.protected(e.node):
                return e
            fallback = fallback or e
        return fallback if take_protected else None

    def _drop_host(self, e: StateEntry) -> None:
        self.host_lru.pop(e, None)
        self.pool.free([e.host_slot])
        e.host_slot = None
        self.stats.state_host_evictions += 1
        if e.file is None:
            del self.entries[e.node]

    # SSD --------------------------------------------------------------------------------
    def _expected(self, e: StateEntry) -> Expected:
        return Expected(self.tiers.fingerprint, self.tiers.salt_hash(e.node.salt),
                        self.tiers.entry(e.node).prefix_hash, e.node.key, self.text,
                        self.layout.nbytes, 0)

    def _write(self, e: StateEntry) -> None:
        writing = sum(x.write is not None for x in self.inflight)
        while len(self.ssd_lru) + len(self.found) + writing >= self.ssd_slots:
            if self.found:  # an earlier run's file no node has come back for: oldest first
                _unlink(self.found.popitem(last=False)[1][1])
                continue
            victim = next((x for x in self.ssd_lru if not x.busy), None)
            if victim is None:
                self.stats.state_ssd_writes_skipped += 1
                return
            self._drop_file(victim)
        self._seq += 1
        entry = self.tiers.entry(e.node)
        path = str(self.dir / f"{entry.prefix_hash.hex()}.{self._seq}{SUFFIX}")
        row = self.host[e.host_slot]
        header = ChunkHeader(self.tiers.fingerprint, self.tiers.salt_hash(e.node.salt),
                             entry.prefix_hash, entry.parent_hash, e.node.depth,
                             self.tiers.layout.page_size, self.layout.nbytes, 0, 0,
                             self.text, e.node.key, self.header_len)
        payload = [memoryview(row.numpy())]  # stored unpadded
        e.write = self.io.submit(Priority.WRITEBACK, lambda: self.file_io.write_chunk(
            path, header, payload, payload))
        e.writing = path
        self.inflight.append(e)

    def _read(self, e: StateEntry, priority: Priority, take_protected: bool = True) -> bool:
        slot = self._alloc_host(take_protected)
        if slot is None:
            return False
        row = self.host[slot]
        path, expected = e.file, self._expected(e)
        e.read_slot = slot
        e.read = self.io.submit(priority, lambda: self._read_file(path, expected, row))
        if e not in self.inflight:
            self.inflight.append(e)
        return True

    def _read_file(self, path: str, want: Expected, row: torch.Tensor) -> str | None:
        """Reads a state file into `row` (on an I/O thread); None when it is valid, else why
        it must not be served (a `tier_stats` reject reason)."""
        payload = [memoryview(row.numpy())]
        try:
            self.file_io.read_chunk(path, want, self.header_len, payload, payload,
                                    self.file_bytes)
        except ChunkError as err:
            return err.reason
        return None

    def _drop_file(self, e: StateEntry) -> None:
        self.ssd_lru.pop(e, None)
        self._delete(e.file)
        e.file = None
        self.stats.state_ssd_evictions += 1
        if e.host_slot is None and not e.busy:
            self.entries.pop(e.node, None)

    def _delete(self, path: str) -> None:
        _unlink(path)  # inline: one metadata operation, and never while I/O uses the file

    def _reject(self, e: StateEntry, reason: str) -> None:
        """A copy that failed its checks: forget the file (and the entry unless in DRAM)."""
        self.stats.chunk_rejects[f"state_{reason}"] += 1
        if e.file is not None:
            self.ssd_lru.pop(e, None)
            self._delete(e.file)
            e.file = None
        if e.host_slot is None and not e.busy and not e.dead:
            self.entries.pop(e.node, None)

    # Completions ------------------------------------------------------------------------
    def reap(self) -> None:
        if not self.inflight:
            return
        still = []
        for e in self.inflight:
            done = True
            if e.write is not None:
                if e.write.done():
                    self._apply_write(e)
                else:
                    done = False
            if e.read is not None:
                if e.read.done():
                    self._apply_read(e)
                else:
                    done = False
            if not done:
                still.append(e)
            elif e.dead and e in self.zombies:
                self.zombies.discard(e)
                self._release(e)
        self.inflight = still

    def _apply_write(self, e: StateEntry) -> None:
        future, e.write = e.write, None
        path, e.writing = e.writing, None
        if future.exception() is not None:
            self.stats.writes_failed += 1
            return
        self.stats.state_ssd_writes += 1
        self.stats.ssd_bytes_written += self.file_bytes
        e.file = path
        if not e.dead:
            self.ssd_lru[e] = None

    def _apply_read(self, e: StateEntry) -> None:
        future, e.read = e.read, None
        slot, e.read_slot = e.read_slot, None
        error = future.exception()
        outcome = IO_ERROR if error is not None else future.result()
        if outcome is None and not e.dead and e.host_slot is None:
            e.host_slot = slot
            self.host_lru[e] = None
            self.stats.ssd_reads += 1
            self.stats.ssd_bytes_read += self.file_bytes
            return
        self.pool.free([slot])
        if outcome is not None:
            self._reject(e, outcome)

    def drain(self) -> None:
        for e in list(self.inflight):
            for f in (e.write, e.read):
                if f is not None:
                    f.exception()
        self.reap()

    def assert_invariants(self) -> None:
        """Every DRAM slot is owned once (an entry's copy, or a read filling it)."""
        owned = [e.host_slot for e in self.entries.values() if e.host_slot is not None]
        owned += [e.host_slot for e in self.zombies if e.host_slot is not None]
        owned += [e.read_slot for e in self.inflight if e.read_slot is not None]
        assert len(owned) == len(set(owned)), f"a DRAM state slot is owned twice: {owned}"
        assert len(owned) == self.pool.num_used, (
            f"{self.pool.num_used} DRAM state slots used, {len(owned)} owned")
        for e in self.host_lru:
            assert e.host_slot is not None and not e.dead
        for e in self.ssd_lru:
            assert e.file is not None and not e.dead
        assert len(self.ssd_lru) + len(self.found) <= max(self.ssd_slots, 0)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
