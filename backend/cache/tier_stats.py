"""Counters of the tiered store (DRAM, SSD, prefetch), exported beside `CacheStats`.

Byte and operation counters are updated on the engine thread when an I/O completion is
reaped, so they are exact at any quiescent point (`TieredBackend.drain()`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Why an SSD chunk was refused (a miss, never wrong KV).
CHECKSUM = "checksum"
TORN = "torn"
FOREIGN = "foreign_model"
SALT = "salt_mismatch"
TOKENS = "token_mismatch"
LAYOUT = "layout_mismatch"
BAD_HEADER = "bad_header"
MISSING = "missing"
IO_ERROR = "io_error"
# Reported from the start (at 0), so dashboards find every page reason's series before the
# first reject; a checkpoint-state file's rejects are `state_<reason>` as they happen.
CHUNK_REJECT_REASONS = (CHECKSUM, TORN, FOREIGN, SALT, TOKENS, LAYOUT, BAD_HEADER, MISSING,
                        IO_ERROR)


@dataclass
class TierStats:
    # DRAM
    host_demotions: int = 0  # device -> DRAM copies at eviction
    host_staged: int = 0  # new pages copied to DRAM at insert (write-back source, offload)
    host_evictions: int = 0  # DRAM copies released to make room
    pages_dropped: int = 0  # pages that left the cache from a lower tier (no copy left)
    promotes_from_host: int = 0  # DRAM -> device (wait_for staged SSD pages in DRAM first)
    promotes_from_ssd: int = 0  # promotions that read SSD themselves (no wait_for before)
    # SSD
    ssd_writes: int = 0
    ssd_bytes_written: int = 0
    ssd_reads: int = 0
    ssd_bytes_read: int = 0
    ssd_read_seconds: float = 0.0  # summed time inside completed reads (I/O threads)
    ssd_deletes: int = 0
    ssd_demotions: int = 0  # synchronous DRAM -> SSD writes to free a DRAM slot
    ssd_budget_evictions: int = 0  # chunks deleted to make room in the byte budget
    writes_skipped_full: int = 0  # budget exhausted or disk full: not written
    writes_skipped_no_dram: int = 0  # no DRAM slot to stage a new page for write-back
    writes_failed: int = 0
    disk_full_events: int = 0
    chunk_rejects: Counter[str] = field(default_factory=Counter)  # reason -> count
    # start-up
    restored_chunks: int = 0  # valid chunks found at start-up
    restored_pages: int = 0  # re-inserted into the tree as SSD-resident nodes
    restored_priorities: int = 0  # ... of them given back a logged retention priority
    stray_temp_files: int = 0
    orphan_chunks: int = 0  # valid chunks whose parent page is gone
    # prefetch (counted per page in `wait_for`)
    prefetch_started: int = 0
    prefetch_hits: int = 0  # read by a prefetch and complete before the request needed it
    prefetch_late: int = 0  # prefetch still in flight when the request needed it
    prefetch_misses: int = 0  # on SSD only when needed: a foreground read
    prefetch_wait_seconds: float = 0.0  # engine time spent waiting for reads (admission)
    deferred_admissions: int = 0  # steps a request stayed queued for its reads while others ran
    # saved states below the device (checkpoints, suffix replay's live states: `state_tier.py`)
    state_spills: int = 0  # device states copied to DRAM when their slot was reclaimed
    state_spills_skipped: int = 0  # no DRAM state slot could be freed: the state was lost
    state_host_evictions: int = 0  # DRAM state copies released (kept on SSD if written)
    state_ssd_writes: int = 0
    state_ssd_writes_skipped: int = 0  # every SSD state file busy
    state_ssd_evictions: int = 0  # state files deleted for the SSD slot limit
    state_loads_host: int = 0  # admissions resumed from a state in DRAM (prefetched or not)
    state_loads_ssd: int = 0  # admissions that waited for a state file to be read
    state_prefetch_started: int = 0
    state_prefetch_hits: int = 0
    state_prefetch_late: int = 0
    state_prefetch_misses: int = 0  # on SSD only when needed: a foreground read
    restored_state_files: int = 0  # an earlier run's state files found at start-up
    restored_states: int = 0  # adopted by their restored (or re-inserted) nodes
    # layer-wise overlap
    layer_loads: int = 0
    layer_offloads: int = 0

    @property
    def checksum_failures(self) -> int:
        return self.chunk_rejects[CHECKSUM]

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "chunk_rejects"}
        out["chunk_rejects"] = {**dict.fromkeys(CHUNK_REJECT_REASONS, 0),
                                **self.chunk_rejects}
        out["checksum_failures"] = self.checksum_failures
        return out
