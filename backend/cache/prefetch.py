"""`Prefetcher`: PCR's queue-based prefetching (section 4.4).

Each step the engine hands over its waiting queue; for the first W requests the prefetcher
raises their pages' eviction priority (look-ahead) and, for matched pages that are on SSD
but not in DRAM, starts SSD -> DRAM reads at the highest I/O priority. When a request is
scheduled, `wait_for` waits only for reads still in flight (reading what no prefetch
covered), so a request that waited in the queue longer than its reads take finds its pages
in DRAM. `reads_pending` lets the scheduler keep a request queued while its reads run
(others step meanwhile) instead of waiting for them on the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

from backend.cache.io_pool import Priority
from backend.cache.radix import encode_tokens
from backend.cache.tier_config import TierConfig


class Prefetcher:
    def __init__(self, tiers, config: TierConfig) -> None:
        self.tiers = tiers
        self.window = config.prefetch_window
        self.enabled = config.uses_prefetch
        self.lookahead = config.enable_lookahead

    def update(self, waiting: Sequence[tuple[Any, str | None]]) -> int:
        """Look-ahead and prefetch for the first W `(tokens, salt)` of the waiting queue
        (queue order). Also ends the previous step's pins. Returns the reads started."""
        tiers = self.tiers
        tiers.begin_step()
        window = list(waiting[: self.window])
        if self.lookahead:
            tiers.store.protect(window)
        if not self.enabled:
            return 0
        started = 0
        for tokens, salt in window:
            tiers.on_lookup(salt)
            path = tiers.store.tree.walk(encode_tokens(tokens), salt)
            if tiers.states is not None:  # the checkpoint state the request will resume from
                tiers.states.prefetch(path)
            for node in path:
                if node.on_device:
                    continue
                e = tiers.entry(node)
                if e.host_slot is not None or not tiers.chunk_ready(e):
                    continue  # in DRAM or on its way
                if not self._read_ahead(e):
                    return started  # DRAM is full of pages in use: try next step
                started += 1
        return started

    def _read_ahead(self, e) -> bool:
        """Starts a prefetch of the entry's SSD copy into a free DRAM slot; False when DRAM
        has no slot to give without waiting (pages in use)."""
        slot = self.tiers.alloc_host(may_wait=False)
        if slot is None:
            return False
        self.tiers.submit_read(e, slot, Priority.PREFETCH)
        e.prefetched = True
        self.tiers.stats.prefetch_started += 1
        return True

    def reads_pending(self, tokens: Any, salt: str | None, timeout: float = 0.0) -> bool:
        """Whether a queued request's matched pages (and, checkpoint policy, the state it
        resumes from) are still being read from SSD after waiting at most `timeout` seconds
        for them. Starts the reads nothing started and applies those that finished. False
        with prefetch off: SCCache's ablation reads when the request is scheduled."""
        if not self.enabled:
            return False
        tiers = self.tiers
        path = tiers.store.tree.walk(encode_tokens(tokens), salt)
        reads = []
        if tiers.states is not None and (state := tiers.states.pending_read(path)) is not None:
            reads.append(state)
        for node in path:
            if node.on_device:
                continue
            e = tiers.entry(node)
            if e.host_ready:
                continue
            if e.read is None and not (tiers.chunk_ready(e) and self._read_ahead(e)):
                break  # no copy to read, or no DRAM slot free: read (or not) when scheduled
            reads.append(e.read.future)
        if not reads:
            return False
        start = time.perf_counter()
        _, running = futures.wait(reads, timeout=timeout)
        tiers.stats.prefetch_wait_seconds += time.perf_counter() - start
        tiers.reap()
        return bool(running)

    def wait_for(self, nodes: Sequence) -> int:
        """Makes the matched `nodes` (root child first) promotable: waits for their reads in
        flight and reads those no prefetch started. Returns how many leading nodes are
        usable (on the device or verified in DRAM, pinned until the next `update`); a page
        whose copy was refused ends the usable prefix and is dropped from the cache."""
        tiers, stats = self.tiers, self.tiers.stats
        tiers.reap()
        usable = len(nodes)
        waits = []
        for i, node in enumerate(nodes):
            if node.on_device:
                continue
            e = tiers.entry(node)
            if e.host_ready:
                stats.prefetch_hits += e.prefetched
            elif e.read is not None:
                stats.prefetch_late += e.prefetched
                waits.append(e.read)
            else:
                slot = tiers.alloc_host() if tiers.chunk_ready(e) else None
                if slot is None:
                    usable = i
                    break
                stats.prefetch_misses += 1
                waits.append(tiers.submit_read(e, slot, Priority.FOREGROUND))
            e.prefetched = False
            tiers.pin_for_step(e)
        if waits:
            start = time.perf_counter()
            for op in waits:
                tiers.wait_op(op)
            stats.prefetch_wait_seconds += time.perf_counter() - start
        for i in range(usable):
            node = nodes[i]
            if not node.alive or not (node.on_device or tiers.entry(node).host_ready):
                return i
        return usable
