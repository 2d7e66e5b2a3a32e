"""SSD tier: chunk format, I/O priorities, O_DIRECT and KvikIO probes, byte budget, and warm
restart (a new store over the same directory serves bit-identical KV)."""

from __future__ import annotations

import os
import threading

import pytest
from tier_helpers import assert_page_served, make_tiered, pages, run_request

from backend.cache.base import Tier
from backend.cache.chunk_format import (
    ChunkError,
    ChunkHeader,
    header_len,
    pack_header,
    prefix_hash,
    salt_hash,
    unpack_header,
)
from backend.cache.file_io import PosixChunkIO, probe_kvikio, probe_o_direct
from backend.cache.io_pool import IOPool, Priority
from backend.cache.page_io import PageLayout


def _header(layout: PageLayout, tokens=b"\x01\x00\x00\x00" * 4) -> ChunkHeader:
    parent = salt_hash("")
    return ChunkHeader(b"f" * 16, parent, prefix_hash(parent, tokens), parent, 0, 4,
                       layout.kv_bytes, 0, 1234, layout.describe(), tokens,
                       header_len(layout))  # fmt: skip


def test_header_round_trip_and_self_checks():
    layout = PageLayout(2, 4, 2, 8, "float32")
    h = _header(layout)
    data = pack_header(h)
    assert len(data) == h.header_len == 4096
    assert unpack_header(data) == h
    flipped = bytearray(data)
    flipped[100] ^= 1
    with pytest.raises(ChunkError, match="bad_header"):
        unpack_header(bytes(flipped))
    with pytest.raises(ChunkError, match="torn"):
        unpack_header(data[:20])


def test_prefix_hash_names_the_whole_prefix_and_the_salt():
    page = b"\x07\x00\x00\x00" * 4
    a = prefix_hash(prefix_hash(salt_hash(""), page), page)
    b = prefix_hash(prefix_hash(salt_hash("tenant"), page), page)
    c = prefix_hash(salt_hash(""), page)
    assert len({a, b, c}) == 3


def test_io_pool_runs_in_priority_order():
    pool = IOPool(1)
    gate = threading.Event()
    order: list[str] = []
    pool.submit(Priority.FOREGROUND, gate.wait)  # holds the only thread
    futures = [
        pool.submit(p, lambda p=p: order.append(p.name))
        for p in (Priority.WRITEBACK, Priority.DELETE, Priority.FOREGROUND, Priority.PREFETCH)
    ]
    gate.set()
    for f in futures:
        f.result(timeout=10)
    pool.close()
    assert order == ["PREFETCH", "FOREGROUND", "DELETE", "WRITEBACK"]


def test_probes_report_what_this_machine_has(tmp_path):
    assert isinstance(probe_o_direct(tmp_path), bool)
    kvikio = probe_kvikio()
    if not __import__("torch").cuda.is_available():
        assert not kvikio.available and "CUDA" in kvikio.reason


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_chunk_io_round_trip(tmp_path, o_direct):
    from backend.cache.host_pool import aligned_empty

    io = PosixChunkIO(o_direct and probe_o_direct(tmp_path))
    src = aligned_empty(8192)
    src.copy_(__import__("torch").randint(0, 255, (8192,), dtype=__import__("torch").uint8))
    path = str(tmp_path / "x.kv")
    assert io.write(path, [memoryview(src.numpy())]) == 8192
    assert not os.path.exists(path + ".tmp")
    dst = aligned_empty(8192)
    n, size = io.read(path, [memoryview(dst.numpy())])
    assert n == size == 8192 and bool((dst == src).all())


def test_restart_serves_bit_identical_kv(tmp_path):
    store, tiers = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    run_request(store, tiers, pages(1, 2, 3))
    run_request(store, tiers, pages(1, 2, 9), salt="tenant")
    tiers.close()
    assert len(list(tmp_path.glob("*.kv"))) == 6

    store2, tiers2 = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    assert tiers2.stats.restored_chunks == 6 and store2.num_cached_pages == 0
    match = store2.match_prefix(pages(1, 2, 3))  # restores the default namespace
    assert [n.kv_location for n in match.nodes] == [Tier.SSD] * 3
    assert store2.num_cached_pages == 3  # the tenant's pages wait for the tenant
    tiers2.assert_invariants()
    _, served = run_request(store2, tiers2, pages(1, 2, 3))  # checks every served page
    assert served == 3
    _, served = run_request(store2, tiers2, pages(1, 2, 9), salt="tenant")
    assert served == 3 and tiers2.stats.restored_pages == 6
    tiers2.assert_invariants()
    tiers2.close()


def test_restart_keeps_the_newest_copy_and_links_children_under_live_parents(tmp_path):
    store, tiers = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    run_request(store, tiers, pages(1, 2))
    tiers.close()
    store2, tiers2 = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    run_request(store2, tiers2, pages(1, 2, 3))  # page 1 and 2 come back from SSD
    tiers2.close()
    store3, tiers3 = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    assert tiers3.stats.restored_chunks == 3
    node = store3.match_prefix(pages(1, 2, 3)).nodes[-1]
    assert node.depth == 2
    tiers3.prefetcher.wait_for(node.path())
    tiers3.close()


def test_byte_budget_evicts_ssd_copies_of_pages_held_elsewhere(tmp_path):
    store, tiers = make_tiered(tmp_path, num_kv_pages=16, host_pages=16)
    chunk_bytes = tiers.ssd.chunk_bytes
    tiers.ssd.budget_bytes = 3 * chunk_bytes
    for i in range(4):
        run_request(store, tiers, pages(10 + i, 20 + i))
        tiers.drain()
        tiers.assert_invariants()
    assert tiers.ssd.used_bytes <= 3 * chunk_bytes
    assert tiers.stats.ssd_budget_evictions >= 5 and tiers.stats.writes_skipped_full == 0
    assert len(list(tmp_path.glob("*.kv"))) == tiers.ssd.used_bytes // chunk_bytes
    tiers.close()


def test_byte_budget_drops_ssd_only_leaves(tmp_path):
    store, tiers = make_tiered(tmp_path, num_kv_pages=4, host_pages=1)
    tiers.ssd.budget_bytes = 2 * tiers.ssd.chunk_bytes
    run_request(store, tiers, pages(1, 2))
    tiers.drain()
    store.evict(2)  # page 2 -> DRAM, page 1 -> DRAM (page 2 -> SSD only)
    run_request(store, tiers, pages(5))
    tiers.drain()
    tiers.assert_invariants()
    assert tiers.stats.pages_dropped >= 1
    assert_page_served(tiers, store.match_prefix(pages(5)).nodes[0], pages(5))
    tiers.close()


def test_int8_anchor_blocks_carry_their_scales_in_the_layout_and_the_slots():
    """An int8 anchor block stores one fp32 scale per row before its rows: both typed views
    of a DRAM slot are aligned and disjoint, and the layout text (in every chunk header)
    names the scales only where they exist, so a chunk of the other kind is a miss."""
    import torch

    from backend.cache.host_pool import HostPool

    plain = PageLayout(2, 4, 2, 8, "float32", 3, 4, 10, "float32")
    int8 = plain._replace(anchor_dtype="int8", anchor_scales=True)
    assert "anchor_scales" not in plain.describe() and int8.describe() != plain.describe()
    assert int8.anchor_bytes == 3 * 4 * 4 + 3 * 4 * 10
    pool = HostPool(int8, 2, pin=False)
    block = pool.anchor_view(1)
    assert block.rows.dtype == torch.int8 and tuple(block.rows.shape) == (3, 4, 10)
    assert block.scales.dtype == torch.float32 and tuple(block.scales.shape) == (3, 4)
    block.scales.fill_(2.5)
    block.rows.fill_(-7)
    again = pool.anchor_view(1)
    assert bool((again.scales == 2.5).all()) and bool((again.rows == -7).all())
    assert pool.anchor_view(1).scales.data_ptr() % 4 == 0
    assert HostPool(plain, 1, pin=False).anchor_view(0).scales is None
