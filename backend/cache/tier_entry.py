"""Per-page state of the lower tiers (`PageNode.tier_data`) and in-flight SSD operations.

Lifetime rules (kept by `TieredBackend`, checked by `tier_invariants.py`):
  H1  `host_slot` set and `host_ready` False means an SSD read is filling the slot (`read`
      is its op); the slot is never served before the read verified the chunk.
  H2  A slot is freed only when no read, no write (the slot is its source) and no pin uses
      it. An entry dropped from the tree while busy is a zombie until then.
  S1  A chunk is readable only once its write completed (`ChunkState.READY`); a page is never
      read from SSD while it is being written (the slot it is written from is in DRAM).
  S2  A chunk is deleted only when no read or write of it is in flight; names are unique per
      write, so a delete never removes a newer copy.
"""

from __future__ import annotations

from concurrent.futures import Future
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.cache.radix import PageNode
    from backend.cache.ssd import SsdChunk


class TierEntry:
    """Lower-tier copies of one page. prefix_hash names the page and its prefix (SSD files);
    pins: holds on the DRAM copy (a scheduled request's `wait_for`, a layer-wise load);
    prefetched: the DRAM copy came from a prefetch not yet consumed; lost: its only copy was
    refused while the node was locked (promotion will fail)."""

    __slots__ = (
        "node",
        "prefix_hash",
        "parent_hash",
        "host_slot",
        "host_ready",
        "chunk",
        "read",
        "write",
        "pins",
        "prefetched",
        "lost",
        "dead",
    )

    def __init__(self, node: PageNode, prefix_hash: bytes, parent_hash: bytes) -> None:
        self.node = node
        self.prefix_hash = prefix_hash
        self.parent_hash = parent_hash
        self.host_slot: int | None = None
        self.host_ready = False
        self.chunk: SsdChunk | None = None
        self.read: Op | None = None
        self.write: Op | None = None
        self.pins = 0
        self.prefetched = False
        self.lost = False
        self.dead = False

    @property
    def io_idle(self) -> bool:
        return self.read is None and self.write is None

    @property
    def idle(self) -> bool:
        return self.read is None and self.write is None and self.pins == 0

    def __repr__(self) -> str:
        return (
            f"TierEntry(depth={self.node.depth}, slot={self.host_slot}, ready={self.host_ready}, "
            f"chunk={self.chunk}, read={self.read is not None}, write={self.write is not None}, "
            f"pins={self.pins}, dead={self.dead})"
        )


class OpKind(IntEnum):
    READ = 0
    WRITE = 1
    DELETE = 2


class Op:
    """An SSD operation in flight; applied once, on the engine thread."""

    __slots__ = ("kind", "entry", "chunk", "future", "applied")

    def __init__(self, kind: OpKind, entry: TierEntry | None, chunk: SsdChunk, future: Future):
        self.kind, self.entry, self.chunk, self.future = kind, entry, chunk, future
        self.applied = False
