"""`IOPool`: SSD I/O threads serving a priority queue (prefetch > foreground reads > deletes >
write-back), so a burst of write-back never delays a read a request is waiting for.

Priorities order the queue only; a started operation runs to completion. FIFO within one
priority. `os.pread` / `os.pwrite` release the GIL, so N threads keep N requests in flight.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any


class Priority(IntEnum):
    PREFETCH = 0
    FOREGROUND = 1
    DELETE = 2
    WRITEBACK = 3


class IOPool:
    """Worker threads running submitted callables in priority order."""

    def __init__(self, num_threads: int, name: str = "ssd-io") -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._heap: list[tuple[int, int, Future, Callable[[], Any]]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, priority: Priority, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("IOPool is closed")
            heapq.heappush(self._heap, (int(priority), next(self._seq), future, fn))
            self._cv.notify()
        return future

    @property
    def num_queued(self) -> int:
        with self._cv:
            return len(self._heap)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, future, fn = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter via the future
                future.set_exception(e)
            else:
                future.set_result(result)

    def close(self, wait: bool = True) -> None:
        """Runs what is queued, then stops the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                t.join()


class InlinePool:
    """Runs each operation at submission (tests, and benchmarks of the bare read path)."""

    def submit(self, priority: Priority, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001
            future.set_exception(e)
        return future

    num_queued = 0

    def close(self, wait: bool = True) -> None:
        pass
