"""`PagePool`: a fixed-size allocator of integer ids with exact accounting.

The pool hands out ids only; the engine owns the physical buffers (KV pages, anchor blocks,
checkpoint slots) and indexes them with these ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PagePool:
    """Ids `0 .. capacity-1`; `alloc` is all-or-nothing, `free` rejects foreign or free ids.

    Invariant: `num_free + num_used == capacity`, and an id is either in the free stack or
    marked used, never both.
    """

    def __init__(self, capacity: int, name: str = "pool") -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (easier to read in tests).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, num: int) -> list[int] | None:
        """Returns `num` distinct ids, or None (and allocates nothing) if fewer are free."""
        if num < 0:
            raise ValueError(f"{self.name}: cannot allocate {num} ids")
        if num > len(self._free):
            return None
        if num == 0:
            return []
        ids = self._free[-num:]
        del self._free[-num:]
        ids.reverse()
        for i in ids:
            self._used[i] = 1
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Returns ids to the pool; raises ValueError (freeing nothing) on a bad id."""
        ids = list(ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.name}: duplicate ids in free({ids})")
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < self.capacity:
                raise ValueError(f"{self.name}: id {i!r} is not in [0, {self.capacity})")
            if not self._used[i]:
                raise ValueError(f"{self.name}: id {i} is already free")
        for i in ids:
            self._used[i] = 0
        self._free.extend(ids)

    def is_allocated(self, page_id: int) -> bool:
        return 0 <= page_id < self.capacity and bool(self._used[page_id])

    def allocated_ids(self) -> set[int]:
        """O(capacity); for invariant checks only."""
        return {i for i, used in enumerate(self._used) if used}

    def check(self) -> None:
        """Asserts the pool's own accounting (used marks agree with the free stack)."""
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: an id is twice in the free stack"
        assert all(not self._used[i] for i in free), f"{self.name}: a free id is marked used"
        assert sum(self._used) == self.num_used, f"{self.name}: used marks != capacity - free"

    def __repr__(self) -> str:
        return f"PagePool({self.name}, used={self.num_used}/{self.capacity})"


class HeldIds:
    """The ids of one pool that callers hold: allocated, and neither adopted by a tree node
    nor freed yet. The store keeps (invariant P2) pool.allocated == referenced + held."""

    def __init__(self, pool: PagePool, what: str) -> None:
        self.pool = pool
        self.what = what
        self.ids: set[int] = set()

    def alloc(self, num: int) -> list[int] | None:
        ids = self.pool.alloc(num)
        if ids:
            self.ids.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        self.check(ids)
        self.pool.free(ids)
        self.ids.difference_update(ids)

    def adopt(self, page_id: int) -> None:
        """A node now references `page_id`: it is no longer the caller's to free."""
        self.ids.remove(page_id)

    def check(self, ids: list[int], owned: Sequence[int | None] = ()) -> None:
        """Raises ValueError unless each ids[i] is held or equals owned[i] (the tree's own)."""
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.what} ids supplied twice: {ids}")
        for i, page_id in enumerate(ids):
            if page_id not in self.ids and not (i < len(owned) and owned[i] == page_id):
                raise ValueError(f"{self.what} {page_id} is not held by the caller")
