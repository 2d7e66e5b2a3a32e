"""Eviction order: PCR's look-ahead LRU over device leaves, and the checkpoint LRU.

Both are min-heaps of `(stamp, seq, node)`, the stamp being (retention priority, access
stamp) (`backend/cache/retention.py`; for checkpoints (priority, not shadowed, access): suffix
replay's shadowed states go first, `Evictor.shadow_states`), with lazy invalidation: an
entry is valid only while the node is still a candidate and its stamp still equals the node's
current stamp, so
re-touching a node just pushes a new entry and the old one is skipped when popped. Each
eviction costs O(log N) amortized instead of a scan over all leaves.

Look-ahead: `protect()` marks the nodes needed by the first W waiting requests with the
current epoch. A protected candidate popped during a pass is set aside (passed over) and
pushed back at the end of the pass; it is taken only if no unprotected candidate is left.
A request's path is a chain, so it holds at most one leaf: the set-aside list is O(W).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from backend.cache.radix import PageNode

_Entry = tuple[tuple[int, ...], int, PageNode]


class _LazyHeap:
    """Min-heap by stamp with passed-over handling for protected nodes."""

    def __init__(
        self,
        is_candidate: Callable[[PageNode], bool],
        stamp_of: Callable[[PageNode], tuple[int, ...]],
        is_protected: Callable[[PageNode], bool],
    ) -> None:
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._is_candidate = is_candidate
        self._stamp_of = stamp_of
        self._is_protected = is_protected
        self._aside: list[_Entry] = []
        self._aside_pos = 0
        self.num_passed_over = 0

    def push(self, node: PageNode) -> None:
        heapq.heappush(self._heap, (self._stamp_of(node), next(self._seq), node))

    def _valid(self, entry: _Entry) -> bool:
        node = entry[2]
        return self._is_candidate(node) and entry[0] == self._stamp_of(node)

    def pop(self) -> PageNode | None:
        """Next victim of the current pass (call `end_pass` when the pass is over)."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not self._valid(entry):
                continue
            if self._is_protected(entry[2]):
                self._aside.append(entry)
                continue
            return entry[2]
        # Only protected candidates remain: take them oldest first (priority, not a pin).
        while self._aside_pos < len(self._aside):
            entry = self._aside[self._aside_pos]
            self._aside_pos += 1
            if self._valid(entry):
                return entry[2]
        return None

    def end_pass(self) -> None:
        for entry in self._aside[self._aside_pos :]:
            if self._valid(entry):
                self.num_passed_over += 1
                heapq.heappush(self._heap, entry)
        self._aside.clear()
        self._aside_pos = 0

    def compact(self, candidates: Iterable[PageNode]) -> None:
        """Rebuilds the heap from the current candidates (drops stale entries)."""
        self._heap = [(self._stamp_of(n), next(self._seq), n) for n in candidates]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def valid_nodes(self) -> set[int]:
        """ids of nodes with a valid entry; for invariant checks."""
        return {id(e[2]) for e in self._heap if self._valid(e)}


class LookaheadLRU:
    """Orders device leaves for eviction; W = `window` (0 = plain LRU)."""

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError(f"look-ahead window must be >= 0, got {window}")
        self.window = window
        self.epoch = 1  # node.protect_epoch starts at 0: nothing is protected initially
        # Lowest retention priority first, least recently used within a priority.
        self.leaves = _LazyHeap(
            is_candidate=is_evictable_leaf,
            stamp_of=lambda n: (n.priority, n.last_access),
            is_protected=self.is_protected,
        )
        self.states = _LazyHeap(
            is_candidate=has_evictable_state,
            # Shadowed states (suffix replay) before the others of their priority.
            stamp_of=lambda n: (n.priority, not n.state_shadowed, n.state_access),
            is_protected=self.is_protected,
        )

    def is_protected(self, node: PageNode) -> bool:
        return node.protect_epoch == self.epoch

    def new_epoch(self) -> int:
        """Ends every earlier protection; returns the epoch to stamp protected nodes with."""
        self.epoch += 1
        return self.epoch

    @property
    def num_passed_over(self) -> int:
        return self.leaves.num_passed_over + self.states.num_passed_over


def is_evictable_leaf(node: PageNode) -> bool:
    """Unlocked, on the device, and no child on the device (only leaves are evicted)."""
    return (
        node.alive
        and node.parent is not None
        and node.lock_ref == 0
        and node.num_device_children == 0
        and node.on_device
    )


def has_evictable_state(node: PageNode) -> bool:
    """Any cached state: a state is read only when a request is admitted (copied into its
    run slot at once), so a lock, which keeps the path's KV for running requests, does not
    pin the checkpoints on it (else a request holding a long matched path could pin every
    slot and no new checkpoint could be saved)."""
    return node.alive and node.state_slot is not None
