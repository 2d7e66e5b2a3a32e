"""Prefetcher: reads start for the SSD-only pages of the first W waiting requests only, a
scheduled request waits just for reads still in flight, and hits / late / misses are
counted; the ablation switches turn prefetch and look-ahead off."""

from __future__ import annotations

import threading

from tier_helpers import make_tiered, pages, run_request

from backend.cache.base import Tier
from backend.cache.file_io import PosixChunkIO


class GatedIO(PosixChunkIO):
    """Reads block until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(o_direct=False)
        self.gate = threading.Event()
        self.num_reads = 0

    def read(self, path, buffers):
        if len(buffers) > 1:  # a page read (header reads at start-up pass)
            assert self.gate.wait(timeout=30)
            self.num_reads += 1
        return super().read(path, buffers)


REQUESTS = [pages(10 + i, 20 + i) for i in range(4)]


def cold_store(tmp_path, **overrides):
    """A restarted store: every cached page is on SSD only."""
    store, tiers = make_tiered(tmp_path, num_kv_pages=16, host_pages=16)
    for tokens in REQUESTS:
        run_request(store, tiers, tokens)
    tiers.close()
    fields = dict(num_kv_pages=16, host_pages=16, prefetch_window=2)
    fields.update(overrides)
    return make_tiered(tmp_path, **fields)


def waiting(requests):
    return [(tokens, "") for tokens in requests]


def test_prefetch_reads_the_window_and_wait_for_counts_hits(tmp_path):
    store, tiers = cold_store(tmp_path)
    assert tiers.prefetcher.update(waiting(REQUESTS)) == 4  # W = 2 requests x 2 pages
    tiers.drain()
    for tokens in REQUESTS[:2]:
        assert [n.kv_location for n in store.match_prefix(tokens).nodes] == [Tier.HOST] * 2
    assert [n.kv_location for n in store.match_prefix(REQUESTS[2]).nodes] == [Tier.SSD] * 2
    match = store.match_prefix(REQUESTS[0])
    assert tiers.prefetcher.wait_for(match.nodes) == 2
    assert tiers.stats.prefetch_hits == 2 and tiers.stats.prefetch_misses == 0
    match = store.match_prefix(REQUESTS[3])
    assert tiers.prefetcher.wait_for(match.nodes) == 2
    assert tiers.stats.prefetch_misses == 2
    tiers.assert_invariants()
    tiers.close()


def test_wait_for_waits_only_for_reads_in_flight(tmp_path):
    io = GatedIO()
    store, tiers = cold_store(tmp_path, chunk_io=io)
    tiers.prefetcher.update(waiting(REQUESTS[:1]))
    match = store.match_prefix(REQUESTS[0])
    assert all(tiers.entry(n).read is not None for n in match.nodes)  # in flight
    threading.Timer(0.2, io.gate.set).start()
    assert tiers.prefetcher.wait_for(match.nodes) == 2
    assert tiers.stats.prefetch_late == 2 and tiers.stats.prefetch_wait_seconds > 0.1
    assert io.num_reads == 2  # nothing was read twice
    store.lock(match.nodes)
    assert store.promote(match.nodes)
    store.unlock(match.nodes)
    tiers.assert_invariants()
    tiers.close()


def test_reads_pending_starts_the_missing_reads_and_waits_at_most_its_timeout(tmp_path):
    """A request outside the window: `reads_pending` starts its pages' reads (counted as
    prefetches) and, while the disk holds them, reports them pending after its timeout;
    once they finish it applies them, and `wait_for` finds the pages in DRAM (hits)."""
    io = GatedIO()
    store, tiers = cold_store(tmp_path, chunk_io=io)
    tiers.prefetcher.update(waiting(REQUESTS[:2]))  # W = 2: request 3 is not covered
    started = tiers.stats.prefetch_started
    assert tiers.prefetcher.reads_pending(REQUESTS[3], "", timeout=0.05)
    assert tiers.stats.prefetch_started == started + 2
    assert tiers.prefetcher.reads_pending(REQUESTS[3], "")  # in flight: nothing started twice
    assert tiers.stats.prefetch_started == started + 2
    io.gate.set()
    assert not tiers.prefetcher.reads_pending(REQUESTS[3], "", timeout=30)
    match = store.match_prefix(REQUESTS[3])
    assert all(tiers.entry(n).host_ready for n in match.nodes)
    assert tiers.prefetcher.wait_for(match.nodes) == 2
    assert tiers.stats.prefetch_hits >= 2 and tiers.stats.prefetch_misses == 0
    assert not tiers.prefetcher.reads_pending(pages(90, 91), "")  # nothing cached
    tiers.drain()
    tiers.assert_invariants()
    tiers.close()


def test_prefetch_off_reads_on_demand(tmp_path):
    store, tiers = cold_store(tmp_path, enable_prefetch=False)
    assert tiers.prefetcher.update(waiting(REQUESTS)) == 0
    _, served = run_request(store, tiers, REQUESTS[0])
    assert served == 2
    assert tiers.stats.prefetch_misses == 2 and tiers.stats.prefetch_started == 0
    # SCCache's ablation: a request never waits in the queue for its reads.
    assert not tiers.prefetcher.reads_pending(REQUESTS[1], "")
    assert tiers.stats.prefetch_started == 0
    tiers.close()


def test_lookahead_switch_controls_protection(tmp_path):
    store, tiers = cold_store(tmp_path)
    epoch = store.policy.epoch
    tiers.prefetcher.update(waiting(REQUESTS))
    assert store.policy.epoch == epoch + 1
    protected = [n for n in store.tree.iter_nodes() if store.policy.is_protected(n)]
    assert len(protected) == 4  # the pages of the first W = 2 requests
    tiers.close()
    store, tiers = make_tiered(tmp_path, num_kv_pages=16, enable_lookahead=False)
    epoch = store.policy.epoch
    tiers.prefetcher.update(waiting(REQUESTS))
    assert store.policy.epoch == epoch
    tiers.close()


def test_prefetch_stops_when_dram_is_full_of_pages_in_use(tmp_path):
    store, tiers = cold_store(tmp_path, host_pages=3, prefetch_window=4)
    match = store.match_prefix(REQUESTS[3])
    assert tiers.prefetcher.wait_for(match.nodes) == 2  # pins two of the three slots
    started = tiers.stats.prefetch_started
    count = tiers.prefetcher.update(waiting(REQUESTS))
    assert count <= 3
    assert tiers.stats.prefetch_started == started + count  # also when DRAM ran out
    tiers.drain()
    tiers.assert_invariants()
    tiers.close()
