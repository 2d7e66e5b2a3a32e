"""Prefetch, eviction and write-back racing: hypothesis draws the engine's operations *and*
when each SSD operation completes, relative to them.

`DeferredPool` holds every submitted I/O until the schedule completes it (or the engine
waits for that one), so schedules are deterministic and shrink; the threaded variant runs
the same programs on a real `IOPool` with random I/O latencies. Checked throughout: every
served page is bit-identical to what was written for its prefix (`run_request`), the
store's and the tiers' invariants hold after every step (exact DRAM and SSD accounting),
no read ever hit a missing or unfinished file (no chunk was refused: none was corrupted),
and at the end the files on disk are exactly the chunks the index holds.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import make_tiered, pages, run_request

from backend.cache.file_io import PosixChunkIO
from backend.cache.io_pool import IOPool
from backend.cache.retention_log import FILE_NAME as LOG_NAME
from backend.cache.ssd import ChunkState


class _LazyFuture(Future):
    """Runs its own task when someone waits for it before the schedule did."""

    def __init__(self, pool: DeferredPool) -> None:
        super().__init__()
        self._pool = pool

    def result(self, timeout=None):
        self._pool.run(self)
        return super().result(timeout)

    def exception(self, timeout=None):
        self._pool.run(self)
        return super().exception(timeout)


class DeferredPool:
    """An I/O pool whose operations run only when completed by the test or waited for."""

    def __init__(self) -> None:
        self.queue: list[tuple[_LazyFuture, object]] = []

    def submit(self, priority, fn) -> Future:
        future = _LazyFuture(self)
        self.queue.append((future, fn))
        return future

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    def run(self, future: _LazyFuture) -> None:
        for i, (f, _) in enumerate(self.queue):
            if f is future:
                self.run_at(i)
                return

    def run_at(self, index: int) -> None:
        future, fn = self.queue.pop(index)
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - the tiers inspect it
            future.set_exception(e)

    def run_all(self) -> None:
        while self.queue:
            self.run_at(0)

    def close(self, wait: bool = True) -> None:
        self.run_all()


class ChaosIO(PosixChunkIO):
    """Real file I/O with random latencies (threaded variant) that records every file's
    life: a page read must find its file written and not being deleted."""

    def __init__(self, seed: int) -> None:
        super().__init__(o_direct=True)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.state: dict[str, str] = {}  # path -> "writing" | "ready" | "deleted"
        self.reading: Counter[str] = Counter()
        self.violations: list[str] = []

    def _nap(self) -> None:
        time.sleep(self.rng.random() * 0.002)

    def _note(self, path: str, state: str) -> None:
        with self.lock:
            if self.reading[path]:
                self.violations.append(f"{state} {path} during a read")
            self.state[path] = state

    def write(self, path, buffers):
        self._note(path, "writing")
        self._nap()
        n = super().write(path, buffers)
        self._note(path, "ready")
        return n

    def read(self, path, buffers):
        page_read = len(buffers) > 1  # (start-up header reads pass)
        with self.lock:
            if page_read and self.state.get(path, "ready") != "ready":
                self.violations.append(f"read of {path} while {self.state[path]}")
            self.reading[path] += 1
        try:
            self._nap()
            return super().read(path, buffers)
        finally:
            with self.lock:
                self.reading[path] -= 1

    def delete(self, path):
        self._note(path, "deleted")
        super().delete(path)


SEQUENCES = [pages(1, 2, 3), pages(1, 2, 4), pages(1, 5), pages(6, 7, 8), pages(1, 2, 3, 9)]
SALTS = ["", "t"]

request = st.tuples(st.just("request"), st.integers(0, 4), st.sampled_from(SALTS))
evict = st.tuples(st.just("evict"), st.integers(1, 6))
update = st.tuples(st.just("update"), st.lists(st.integers(0, 4), max_size=4))
complete = st.tuples(st.just("complete"), st.integers(0, 50))
complete_all = st.tuples(st.just("complete_all"))
restart = st.tuples(st.just("restart"))
forget = st.tuples(st.just("forget"), st.integers(0, 50))  # drop an off-device page
program = st.lists(
    st.one_of(
        request,
        request,
        request,
        evict,
        evict,
        update,
        update,
        forget,
        complete,
        complete,
        complete_all,
        restart,
    ),  # fmt: skip
    min_size=5,
    max_size=40,
)


def _build(directory, pool, chunk_io=None, host_pages=3, overlap=False):
    store, tiers = make_tiered(
        directory,
        num_kv_pages=6,
        host_pages=host_pages,
        io_pool=pool,
        chunk_io=chunk_io,
        io_threads=2,
        enable_overlap=overlap,
    )
    tiers.ssd.budget_bytes = 8 * tiers.ssd.chunk_bytes
    return store, tiers


def _run_program(directory, steps, make_pool, chunk_io=None, deferred=True, **shape):
    pool = make_pool()
    store, tiers = _build(directory, pool, chunk_io, **shape)
    for step in steps:
        kind = step[0]
        if kind == "request":
            run_request(store, tiers, SEQUENCES[step[1]], step[2])
        elif kind == "evict":
            store.evict(step[1])
        elif kind == "update":
            tiers.prefetcher.update([(SEQUENCES[i], "") for i in step[1]])
        elif kind == "complete" and deferred and pool.queue:
            pool.run_at(step[1] % len(pool.queue))
        elif kind == "complete_all" and deferred:
            pool.run_all()
        elif kind == "forget":
            _forget(tiers, step[1])
        elif kind == "restart":
            tiers.close()
            pool = make_pool()
            store, tiers = _build(directory, pool, chunk_io, **shape)
        if not deferred:
            tiers.reap()
        tiers.assert_invariants()
        assert not tiers.stats.chunk_rejects, tiers.stats.chunk_rejects
    tiers.drain()
    tiers.assert_invariants()
    _check_files(tiers)
    assert not tiers.stats.chunk_rejects and tiers.stats.writes_failed == 0
    tiers.close()


def _forget(tiers, index: int) -> None:
    """Drops an unlocked off-device page (with its descendants), as budget eviction or a
    refused chunk does, whatever I/O of theirs is in flight."""
    nodes = [n for n in tiers.store.tree.iter_nodes() if not n.on_device and not n.lock_ref]
    busy = [n for n in nodes if n.tier_data is not None and not n.tier_data.io_idle]
    nodes = busy or nodes  # the interesting case: I/O of the page still in flight
    if nodes:
        tiers.store.drop_subtree(nodes[index % len(nodes)])


def _check_files(tiers) -> None:
    on_disk = {str(p) for p in tiers.ssd.dir.glob("*") if p.name != LOG_NAME}
    indexed = {e.chunk.path for e in tiers.ssd_lru}
    indexed |= {c.path for items in tiers.pending_restore.values() for c, _ in items}
    assert all(e.chunk.state == ChunkState.READY for e in tiers.ssd_lru)
    assert on_disk == indexed, (sorted(on_disk - indexed)[:3], sorted(indexed - on_disk)[:3])
    assert tiers.ssd.used_bytes == sum(os.path.getsize(p) for p in on_disk)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=program, host_pages=st.integers(1, 4), overlap=st.booleans())
def test_deferred_io_schedules_keep_data_and_accounting_exact(
    tmp_path_factory, steps, host_pages, overlap
):
    directory = tmp_path_factory.mktemp("ssd")
    _run_program(directory, steps, DeferredPool, host_pages=host_pages, overlap=overlap)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=program, seed=st.integers(0, 2**16), overlap=st.booleans())
def test_threaded_io_with_random_latency(tmp_path_factory, steps, seed, overlap):
    directory = tmp_path_factory.mktemp("ssd")
    chaos = ChaosIO(seed)
    _run_program(directory, steps, lambda: IOPool(2), chaos, deferred=False, overlap=overlap)
    assert not chaos.violations, chaos.violations[:3]  # fmt: skip


def test_a_read_in_flight_for_a_dropped_page_is_never_served(tmp_path):
    pool = DeferredPool()
    store, tiers = _build(tmp_path, pool)
    run_request(store, tiers, pages(1, 2))
    pool.run_all()
    tiers.close()
    pool = DeferredPool()
    store, tiers = _build(tmp_path, pool)
    tiers.prefetcher.update([(pages(1, 2), "")])  # two reads queued
    node = store.match_prefix(pages(1, 2)).nodes[0]
    assert tiers.entry(node).read is not None
    tiers.on_lost(tiers.entry(node))  # the page leaves the tree while its read is queued
    assert not node.alive and len(tiers.zombies) == 2
    tiers.assert_invariants()
    pool.run_all()
    tiers.reap()
    assert not tiers.zombies and tiers.host.num_free == 3  # slots back, nothing served
    tiers.drain()
    assert not list(tmp_path.glob("*.kv"))  # the files went with the pages
    tiers.assert_invariants()
    tiers.close()


def test_a_page_is_not_read_from_ssd_before_its_write_completed(tmp_path):
    pool = DeferredPool()
    store, tiers = _build(tmp_path, pool)
    run_request(store, tiers, pages(1))
    node = store.match_prefix(pages(1)).nodes[0]
    e = tiers.entry(node)
    assert e.chunk.state == ChunkState.WRITING and e.host_ready  # its DRAM copy is the source
    store.evict(1)
    assert node.kv_location.name == "HOST"
    tiers.prefetcher.update([(pages(1), "")])
    assert e.read is None  # nothing to prefetch: the page is in DRAM
    _, served = run_request(store, tiers, pages(1))
    assert served == 1
    pool.run_all()
    tiers.drain()
    tiers.assert_invariants()
    tiers.close()
