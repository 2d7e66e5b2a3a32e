"""`TieredBackend`: PCR's DRAM and SSD tiers under the device pools of `PrefixStore`.

Integration guide (all calls on the engine thread; the store is not thread-safe):

  construction
      buffers = DeviceBuffers.from_executor(executor, cache_cfg.anchors_per_page,
                                            with_anchors=cache_cfg.uses_anchors)
      tiers = TieredBackend(tier_cfg, buffers)
      store = PrefixStore(cache_cfg, tiers)            # calls tiers.attach(store)
  every step, before scheduling
      tiers.prefetcher.update([(r.tokens, r.salt) for r in waiting])   # look-ahead + prefetch
  scheduling a request
      match = store.match_prefix(tokens[:-1], salt)
      n = tiers.prefetcher.wait_for(match.nodes)       # usable pages: now on device or DRAM
      nodes = match.nodes[:n]                          # (recompute from page n on)
      store.lock(nodes)
      if not store.promote(nodes): unlock and retry later (device pools full of locked pages)
      kv_pages, anchor_blocks = [x.kv_page for x in nodes], [x.anchor_block for x in nodes]
  the forward
      load = tiers.start_layer_load()                  # promoted KV, one layer at a time
      offload = tiers.start_layer_offload(new_kv_pages)  # pages this forward writes
      model(..., before attention layer a: load.wait(a); after it wrote KV: offload.layer_done(a))
      offload.finish()
  after the forward
      store.insert(...)          # -> tiers.on_insert: DRAM copies adopted, SSD write-back queued
      store.free_pages(dups)     # -> tiers.on_free: staged copies of those pages released
  metrics / shutdown
      tiers.stats.as_dict(); tiers.close()
With `enable_overlap=False` the two layer-wise objects are no-ops and promotion copies at once.

Policy: device eviction demotes to DRAM (DRAM full: its LRU entry is released first: free if it
has an SSD or device copy, else written to SSD synchronously, else dropped if a leaf), or to
SSD if no DRAM slot is free, else drops. New pages are staged in DRAM at insert and written
to SSD in the background; a staging copy of a page still on the device is the first DRAM
copy evicted once its write completed. Look-ahead-protected pages are evicted last on every
tier. Budget eviction on SSD deletes copies of pages held elsewhere, or drops SSD-only leaves.
"""

from __future__ import annotations

import time
from collections import deque

from backend.cache.base import EvictAction, EvictDecision, Tier, TierBackend
from backend.cache.chunk_format import fingerprint_hash
from backend.cache.file_io import KvikioChunkIO, probe_kvikio
from backend.cache.host_pool import HostPool
from backend.cache.io_pool import IOPool, Priority
from backend.cache.overlap import LayerwiseLoad, LayerwiseOffload, TransferThread
from backend.cache.page_io import CopyStream, DeviceBuffers
from backend.cache.prefetch import Prefetcher
from backend.cache.retention import DEFAULT_PRIORITY
from backend.cache.retention_log import RetentionLog
from backend.cache.ssd import SsdStore
from backend.cache.state_tier import StateTier, state_file_bytes
from backend.cache.tier_config import TierConfig
from backend.cache.tier_entry import TierEntry
from backend.cache.tier_io import TierIO
from backend.cache.tier_restore import restore_namespace
from backend.cache.tier_space import TierSpace
from backend.cache.tier_stats import TierStats


class PageLostError(RuntimeError):
    """A page's only copy was refused after its node was locked (call `wait_for` first)."""


class TieredBackend(TierSpace, TierIO, TierBackend):
    def __init__(
        self,
        config: TierConfig,
        buffers: DeviceBuffers,
        io_pool: IOPool | None = None,
        chunk_io=None,
        state_tag: str = "",
    ) -> None:
        """state_tag: written into (and required of) every saved state's SSD header beside
        its layout: suffix replay's live states may be replayed ones, which hold only for
        the replay configuration that rebuilt them (`Engine` passes it)."""
        self.config, self.buffers = config, buffers
        self.state_tag = state_tag
        self.layout = buffers.layout
        self.uses_anchors = self.layout.has_anchors
        self.stats = TierStats()
        self.host = HostPool(self.layout, config.host_pages)
        self.copies = CopyStream(buffers.device)
        self.fingerprint = fingerprint_hash(config.model_fingerprint)
        self.store = None
        self._init_io()
        self._deferred_loads: list[tuple[TierEntry, int]] = []
        self._loads: list[tuple[LayerwiseLoad, list[TierEntry]]] = []
        self._offload: LayerwiseOffload | None = None
        self.staged: dict[int, int] = {}  # device KV page -> DRAM slot filled by the offload
        self.step_pins: dict[TierEntry, int] = {}  # wait_for holds until promote / next step
        self.backlog: deque[TierEntry] = deque()  # new pages waiting for a DRAM staging slot
        self.pending_restore: dict[bytes, list] = {}  # salt hash -> [(chunk, header)]
        self.ssd: SsdStore | None = None
        self.state_reserve = 0  # SSD bytes set aside from ssd_bytes for state files
        self.retention_log: RetentionLog | None = None  # priorities across restarts (SSD)
        self.io = None
        if config.uses_ssd:
            self.io = io_pool or IOPool(config.io_threads)
            if chunk_io is None and config.use_kvikio and probe_kvikio().available:
                chunk_io = KvikioChunkIO()
            # The saved states' SSD files (at most ssd_checkpoint_slots) are paid from
            # ssd_bytes too: the page chunks get what they leave.
            self.state_reserve = reserve = self._state_files_bytes()
            if reserve >= config.ssd_bytes:
                raise ValueError(
                    f"ssd_checkpoint_slots={config.ssd_checkpoint_slots} state files "
                    f"({reserve} bytes) leave nothing of ssd_bytes={config.ssd_bytes} for "
                    "page chunks")
            self.ssd = SsdStore(config.ssd_path, config.ssd_bytes - reserve, self.layout,
                                self.fingerprint, self.io, self.stats, chunk_io,
                                config.o_direct)  # fmt: skip
            for chunk, header in self.ssd.scan():
                self.pending_restore.setdefault(header.salt_hash, []).append((chunk, header))
            self.retention_log = RetentionLog(config.ssd_path, {
                h.prefix_hash for items in self.pending_restore.values() for _, h in items})
        self.states: StateTier | None = None  # saved states (set up in attach)
        threads = config.enable_overlap and not self.copies.is_cuda
        self._load_worker = TransferThread("kv-load") if threads else None
        self._offload_worker = TransferThread("kv-offload") if threads else None
        self.prefetcher = Prefetcher(self, config)

    def _state_files_bytes(self) -> int:
        """The SSD bytes the saved states' files may take (`StateTier`: ssd_checkpoint_slots
        files, where states have DRAM slots to go through)."""
        cfg = self.config
        if not (cfg.ssd_checkpoint_slots and cfg.host_checkpoint_slots) or \
                self.buffers.states is None:
            return 0
        return cfg.ssd_checkpoint_slots * state_file_bytes(self.buffers.states, self.state_tag,
                                                           self.layout.page_size)

    # TierBackend hooks ------------------------------------------------------------------
    def attach(self, store) -> None:
        if store.page_size != self.layout.page_size:
            raise ValueError(
                f"store page_size={store.page_size} != device layout {self.layout.page_size}"
            )
        if store.uses_anchors != self.uses_anchors:
            raise ValueError(
                f"store uses_anchors={store.uses_anchors} but the device buffers "
                f"{'have' if self.uses_anchors else 'lack'} anchors"
            )
        if store.config.num_kv_pages > self.buffers.num_pages:
            raise ValueError(
                f"store has {store.config.num_kv_pages} KV pages, buffers {self.buffers.num_pages}"
            )
        self.store = store
        cfg = self.config
        policy = store.config.policy
        if policy in ("checkpoint", "suffixreplay") and cfg.host_checkpoint_slots:
            if self.buffers.states is None:
                raise ValueError("host_checkpoint_slots needs the executor's saved-state slots "
                                 "(DeviceBuffers(states=...))")
            # Suffix replay resumes from a lower tier's state only at its match's end (a
            # state short of it is worth a load only on the device: `_resume_short`).
            self.states = StateTier(self, self.buffers.states, cfg.host_checkpoint_slots,
                                    cfg.ssd_path if self.ssd is not None else None,
                                    cfg.ssd_checkpoint_slots, self.io, tag=self.state_tag,
                                    end_only=policy == "suffixreplay")
        elif self.ssd is not None:  # no state files: their bytes go back to the chunks
            self.ssd.budget_bytes += self.state_reserve
            self.state_reserve = 0

    def on_state_evict(self, node, slot: int) -> None:
        if self.states is not None:
            self.states.spill(node, slot)

    def has_state(self, node) -> bool:
        return self.states is not None and self.states.has(node)

    def load_state(self, node, dst, dst_slot: int) -> bool:
        return self.states is not None and self.states.load(node, dst, dst_slot)

    def on_lookup(self, salt: str | None) -> None:
        if self.pending_restore:
            items = self.pending_restore.pop(self.salt_hash(salt or ""), None)
            if items:
                restore_namespace(self, salt or "", items)

    def on_evict(self, node) -> EvictDecision:
        self.reap()
        e = self.entry(node)
        anchor_tier = Tier.HOST if self.uses_anchors else None
        if e.host_ready:
            self.touch_host(e)
            return EvictDecision(EvictAction.DEMOTE, Tier.HOST, anchor_tier)
        if e.host_slot is None:
            slot = self.alloc_host()
            if slot is not None:
                ready = self._copy_out(node, slot)
                e.host_slot, e.host_ready = slot, True
                self.touch_host(e)
                self.stats.host_demotions += 1
                if self.ssd is not None and e.chunk is None:
                    self.queue_writeback(e, ready)
                return EvictDecision(EvictAction.DEMOTE, Tier.HOST, anchor_tier)
        if self.chunk_ready(e):  # (also when a read is filling the DRAM slot)
            ssd_tier = Tier.SSD if self.uses_anchors else None
            return EvictDecision(EvictAction.DEMOTE, Tier.SSD, ssd_tier)
        return EvictDecision(EvictAction.DROP)

    def on_retain(self, node, priority: int, duration_s: float | None) -> None:
        if self.retention_log is not None:
            expires = None if duration_s is None else time.time() + duration_s
            self.retention_log.record(self.entry(node).prefix_hash, priority, expires)

    def on_remove(self, node) -> None:
        if self.states is not None:
            self.states.remove(node)
        e = node.tier_data
        if e is None or e.dead:
            return
        if self.retention_log is not None:  # a later page of the same prefix starts afresh
            self.retention_log.record(e.prefix_hash, DEFAULT_PRIORITY, None)
        e.dead = True
        if self.by_hash.get(e.prefix_hash) is e:
            del self.by_hash[e.prefix_hash]
        self.host_lru.pop(e, None)
        self.ssd_lru.pop(e, None)
        self.zombies.add(e)
        self.release_if_idle(e)

    def on_reset(self, salt: str | None) -> None:
        """Chunks an earlier run left on SSD for the namespace (every namespace: all of them,
        and the checkpoint states' files) are deleted before any request restores them."""
        if salt is None:
            pending, self.pending_restore = list(self.pending_restore.values()), {}
            if self.states is not None:
                self.states.forget_found()
        else:
            pending = [self.pending_restore.pop(self.salt_hash(salt), [])]
        for items in pending:
            for chunk, _ in items:
                self.delete_chunk(chunk)
        self.reap()

    def on_promote(self, node, kv_page: int, anchor_block: int | None) -> None:
        self.reap()
        e = self.entry(node)
        from_ssd = not e.host_ready
        if not e.host_ready and not e.lost:
            if e.read is None:
                slot = self.alloc_host() if self.chunk_ready(e) else None
                if slot is not None:
                    self.submit_read(e, slot, Priority.FOREGROUND)
            if e.read is not None:
                self.wait_op(e.read)
        if not e.host_ready:
            why = (
                "its only copy was refused"
                if e.lost or not self.chunk_ready(e)
                else ("no DRAM slot could be freed to stage its SSD copy")
            )
            raise PageLostError(f"cannot promote {node!r}: {why} (call wait_for first)")
        slot = e.host_slot
        defer = self.config.enable_overlap

        def copies() -> None:
            if anchor_block is not None:
                self.buffers.copy_anchor_in(anchor_block, self.host.anchor_view(slot), nb)
            if not defer:
                self.buffers.copy_page_in(kv_page, self.host.kv_view(slot), nb)

        nb = self.copies.non_blocking
        self.copies.run(copies)
        if defer:
            e.pins += 1
            self._deferred_loads.append((e, kv_page))
        e.pins -= self.step_pins.pop(e, 0)  # on the device now: wait_for's hold is done
        self.touch_host(e)
        if from_ssd:
            self.stats.promotes_from_ssd += 1
        else:
            self.stats.promotes_from_host += 1

    def on_insert(self, nodes) -> None:
        if self._deferred_loads:
            raise RuntimeError("promoted KV was never loaded: call start_layer_load() first")
        self.reap()
        self._stage_backlog()
        if self._offload is not None and any(n.kv_page in self.staged for n in nodes):
            self._offload.finish()
        for node in nodes:
            e = self.entry(node)
            slot = self.staged.pop(node.kv_page, None)
            if slot is not None and e.host_slot is None:
                ready = self._copy_out(node, slot, kv=False)  # KV came with the offload
                self._adopt_staged(e, slot, ready)
            elif slot is not None:
                self.host.free(slot)
            elif self.ssd is not None and e.host_slot is None and e.chunk is None:
                if self.backlog or not self._stage(e):
                    self.backlog.append(e)  # staged when DRAM slots come free (begin_step)
            elif self.ssd is not None and e.host_ready:
                self.queue_writeback(e)

    def _stage(self, e: TierEntry) -> bool:
        """Copies a device page to a DRAM slot and queues its write-back, never waiting
        for the disk; False when no slot can be had now."""
        slot = self.alloc_host(may_wait=False)
        if slot is None:
            return False
        self._adopt_staged(e, slot, self._copy_out(e.node, slot))
        return True

    def _adopt_staged(self, e: TierEntry, slot: int, ready) -> None:
        e.host_slot, e.host_ready = slot, True
        self.touch_host(e)
        self.stats.host_staged += 1
        if self.ssd is not None:
            self.queue_writeback(e, ready)

    def _stage_backlog(self) -> None:
        """Stages deferred new pages, oldest first, while DRAM slots can be had."""
        while self.backlog:
            e = self.backlog[0]
            done = e.dead or not e.node.on_device or e.host_slot is not None or e.chunk
            if not done and not self._stage(e):
                return
            self.backlog.popleft()

    def on_free(self, kv_pages, anchor_blocks) -> None:
        for page in kv_pages:
            slot = self.staged.pop(page, None)
            if slot is not None:
                if self._offload is not None:
                    self._offload.finish()
                self.host.free(slot)

    # Layer-wise overlap -----------------------------------------------------------------
    def start_layer_load(self) -> LayerwiseLoad:
        """Starts loading the KV of every page promoted since the last call."""
        items, self._deferred_loads = self._deferred_loads, []
        load = LayerwiseLoad(self.buffers, self.host, self._load_worker,
                             [(e.host_slot, page) for e, page in items],
                             self.copies.stream)  # fmt: skip
        load.start()
        if items:
            self._loads.append((load, [e for e, _ in items]))
            self.stats.layer_loads += 1
        return load

    def start_layer_offload(self, kv_pages) -> LayerwiseOffload:
        """DRAM slots for the KV the next forward writes into `kv_pages`; their copies are
        adopted by `on_insert` (no copy then) and feed the SSD write-back."""
        self.reap()
        self._release_staged()
        items = []
        if self.config.enable_overlap:
            for page in kv_pages:
                slot = self.alloc_host(may_wait=False)
                if slot is None:
                    break
                items.append((page, slot))
                self.staged[page] = slot
        self._offload = LayerwiseOffload(self.buffers, self.host, self._offload_worker, items,
                                         self.copies.stream)  # fmt: skip
        if items:
            self.stats.layer_offloads += 1
        return self._offload

    def finish_loads(self) -> None:
        """Waits for every layer-wise load (tests; the engine waits per layer)."""
        if self._deferred_loads:
            self.start_layer_load()
        for load, _ in self._loads:
            load.wait_all()
        self.reap()

    # Step bookkeeping -------------------------------------------------------------------
    def begin_step(self) -> None:
        """Reaps completions, ends last step's pins (called by `Prefetcher.update`)."""
        self.reap()
        pins, self.step_pins = self.step_pins, {}
        for e, n in pins.items():
            e.pins -= n
            self.release_if_idle(e)
        self._stage_backlog()

    def pin_for_step(self, e: TierEntry) -> None:
        e.pins += 1
        self.step_pins[e] = self.step_pins.get(e, 0) + 1

    def reap(self) -> None:
        super().reap()
        if self.states is not None:
            self.states.reap()
        if self._loads:
            still = []
            for load, entries in self._loads:
                if not load.done:
                    still.append((load, entries))
                    continue
                for e in entries:
                    e.pins -= 1
                    self.release_if_idle(e)
            self._loads = still

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the lower tiers hold: DRAM slots in use (pages and checkpoint states) and,
        with an SSD tier, its files (chunks being written, ready or being deleted, and state
        files)."""
        host = self.host.slots.num_used * (self.layout.kv_stride + self.layout.anchor_stride)
        if self.states is not None:
            host += self.states.pool.num_used * self.states.layout.nbytes
        if self.ssd is None:
            return {"host": host}
        ssd = self.ssd.used_bytes
        if self.states is not None:
            ssd += (len(self.states.ssd_lru) + len(self.states.found)) * self.states.file_bytes
        return {"host": host, "ssd": ssd}

    def drain(self) -> None:
        """Waits until every SSD operation and every deferred write-back is done."""
        while True:
            super().drain()
            if self.states is not None:
                self.states.drain()
            self._stage_backlog()
            if not self.inflight:
                return

    def close(self) -> None:
        self.finish_loads()
        if self._offload is not None:
            self._offload.finish()
        self._release_staged()
        self.drain()
        for worker in (self._load_worker, self._offload_worker):
            if worker is not None:
                worker.close()
        if self.io is not None:
            self.io.close()

    def assert_invariants(self) -> None:
        from backend.cache.tier_invariants import check_tiers

        check_tiers(self)
        if self.states is not None:
            self.states.assert_invariants()

    # Helpers ----------------------------------------------------------------------------
    def _copy_out(self, node, slot: int, kv: bool = True):
        """Device -> DRAM copy of a node's page (KV and/or anchor block)."""
        nb = self.copies.non_blocking

        def copies() -> None:
            if kv:
                self.buffers.copy_page_out(node.kv_page, self.host.kv_view(slot), nb)
            if self.uses_anchors and node.anchor_block is not None:
                self.buffers.copy_anchor_out(node.anchor_block, self.host.anchor_view(slot), nb)

        return self.copies.run(copies)

    def _release_staged(self) -> None:
        if self._offload is not None and self.staged:
            self._offload.finish()
        for slot in self.staged.values():
            self.host.free(slot)
        self.staged.clear()

    def on_lost(self, e: TierEntry) -> None:
        """The only copy of an off-device page was refused: drop it (and its descendants),
        unless a request holds it locked."""
        if e.node.lock_ref:
            e.lost = True
            return
        self.stats.pages_dropped += self.store.drop_subtree(e.node)
