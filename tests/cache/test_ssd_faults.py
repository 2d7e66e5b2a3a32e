"""SSD faults: a flipped byte, a truncated file, another model's files, another tenant's
chunk, a stray temp file, a full disk. Each is a miss (never wrong KV: `run_request` checks
every served page bit for bit), is counted, and serving goes on."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid

import pytest
from tier_helpers import PAGE, make_tiered, pages, run_request

from backend.cache.chunk_format import prefix_hash, salt_hash
from backend.cache.radix import encode_tokens
from backend.cache.tier_stats import BAD_HEADER, CHECKSUM, FOREIGN, SALT, TORN


def chunk_file(directory, tokens, depth, salt=""):
    """Path of the chunk of page `depth` of `tokens` (its name is its prefix hash)."""
    h = salt_hash(salt)
    for i in range(depth + 1):
        h = prefix_hash(h, encode_tokens(tokens[i * PAGE : (i + 1) * PAGE]))
    (path,) = directory.glob(f"{h.hex()}.*.kv")
    return path


def written(directory, *requests, salt=""):
    """Caches the requests in a store over `directory`, then shuts it down."""
    store, tiers = make_tiered(directory, num_kv_pages=16, host_pages=8)
    for tokens in requests:
        run_request(store, tiers, tokens, salt)
    tiers.close()


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def drop_dram_copies(tiers):
    """Leaves SSD as the only lower tier of every off-device page."""
    tiers.drain()
    for e in list(tiers.host_lru):
        if e.idle and tiers.chunk_ready(e) and not e.node.on_device:
            tiers.free_host(e)
            tiers.sync_location(e)


def test_flipped_payload_byte_is_a_counted_miss(tmp_path):
    tokens = pages(1, 2, 3)
    written(tmp_path, tokens)
    path = chunk_file(tmp_path, tokens, depth=1)
    flip_byte(path, 4096 + 100)  # inside the KV section (the header is 4 KiB)
    store, tiers = make_tiered(tmp_path, num_kv_pages=16, host_pages=8)
    match = store.match_prefix(tokens)
    assert match.num_matched_pages == 3
    assert tiers.prefetcher.wait_for(match.nodes) == 1  # page 2 refused, page 3 unreachable
    assert tiers.stats.chunk_rejects[CHECKSUM] == 1 and tiers.stats.checksum_failures == 1
    assert store.num_cached_pages == 1 and tiers.stats.pages_dropped == 2
    tiers.assert_invariants()
    _, served = run_request(store, tiers, tokens)  # recomputes pages 2 and 3
    assert served == 1
    tiers.drain()
    assert not path.exists()  # the corrupt file was deleted
    tiers.assert_invariants()
    tiers.close()


def test_flipped_header_byte_is_skipped_at_start(tmp_path):
    tokens = pages(1, 2)
    written(tmp_path, tokens)
    flip_byte(chunk_file(tmp_path, tokens, depth=0), 70)
    store, tiers = make_tiered(tmp_path, num_kv_pages=16, host_pages=8)
    assert tiers.stats.chunk_rejects[BAD_HEADER] == 1
    assert store.match_prefix(tokens).num_matched_pages == 0  # page 2 is an orphan now
    assert tiers.stats.orphan_chunks == 1
    run_request(store, tiers, tokens)
    tiers.assert_invariants()
    tiers.close()


def test_truncated_file_is_torn_at_start_and_at_read(tmp_path):
    tokens = pages(1, 2, 3)
    written(tmp_path, tokens)
    os.truncate(chunk_file(tmp_path, tokens, depth=2), 5000)
    store, tiers = make_tiered(tmp_path, num_kv_pages=16, host_pages=8)
    assert tiers.stats.chunk_rejects[TORN] == 1
    match = store.match_prefix(tokens)
    assert match.num_matched_pages == 2
    # Truncated after start-up: found when the page is read.
    path = chunk_file(tmp_path, tokens, depth=1)
    os.truncate(path, os.path.getsize(path) - 4096)
    assert tiers.prefetcher.wait_for(match.nodes) == 1
    assert tiers.stats.chunk_rejects[TORN] == 2
    _, served = run_request(store, tiers, tokens)
    assert served == 1
    tiers.assert_invariants()
    tiers.close()


def test_another_models_files_are_foreign_and_left_alone(tmp_path):
    tokens = pages(1, 2)
    written(tmp_path, tokens)
    store, tiers = make_tiered(tmp_path, num_kv_pages=16, model_fingerprint="other-model")
    assert tiers.stats.chunk_rejects[FOREIGN] == 2 and tiers.stats.restored_chunks == 0
    assert store.match_prefix(tokens).num_matched_pages == 0
    assert tiers.ssd.used_bytes == 0
    tiers.close()
    assert len(list(tmp_path.glob("*.kv"))) == 2  # not ours to delete
    store, tiers = make_tiered(tmp_path, num_kv_pages=16)
    assert tiers.stats.restored_chunks == 2
    _, served = run_request(store, tiers, tokens)
    assert served == 2
    tiers.close()


def test_another_tenants_chunk_is_refused(tmp_path):
    store, tiers = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    run_request(store, tiers, pages(1, 2), salt="a")
    run_request(store, tiers, pages(1, 2), salt="b")
    store.evict(4)
    drop_dram_copies(tiers)
    # Tenant b's first page now holds tenant a's bytes (same tokens, other salt).
    shutil.copyfile(chunk_file(tmp_path, pages(1, 2), 0, "a"),
                    chunk_file(tmp_path, pages(1, 2), 0, "b"))  # fmt: skip
    match = store.match_prefix(pages(1, 2), "b")
    assert tiers.prefetcher.wait_for(match.nodes) == 0
    assert tiers.stats.chunk_rejects[SALT] == 1
    _, served = run_request(store, tiers, pages(1, 2), salt="b")
    assert served == 0
    _, served = run_request(store, tiers, pages(1, 2), salt="a")
    assert served == 2
    tiers.assert_invariants()
    tiers.close()


def test_stray_temp_file_from_an_interrupted_write(tmp_path):
    tokens = pages(1)
    written(tmp_path, tokens)
    good = chunk_file(tmp_path, tokens, depth=0)
    stray = good.with_name(good.name.replace(".kv", ".ff.kv.tmp"))
    stray.write_bytes(good.read_bytes()[:6000])  # what a crash mid-write leaves
    store, tiers = make_tiered(tmp_path, num_kv_pages=16)
    assert tiers.stats.stray_temp_files == 1 and not stray.exists()
    assert tiers.stats.restored_chunks == 1
    _, served = run_request(store, tiers, tokens)
    assert served == 1
    tiers.close()


def test_exhausted_budget_stops_writes_and_serving_continues(tmp_path, caplog):
    store, tiers = make_tiered(tmp_path, num_kv_pages=8, host_pages=4, ssd_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="backend.cache.ssd"):
        for i in range(3):
            assert run_request(store, tiers, pages(40 + i, 50 + i)) is not None
    assert tiers.stats.writes_skipped_full == 6 and tiers.stats.ssd_writes == 0
    assert sum("budget" in r.message for r in caplog.records) == 1  # warned once
    _, served = run_request(store, tiers, pages(40, 50))
    assert served == 2
    tiers.assert_invariants()
    tiers.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount)],
                       check=True, capture_output=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a small tmpfs here: {e}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False, capture_output=True, timeout=10)


def test_full_disk_stops_writes_and_serving_continues(tiny_tmpfs, caplog):
    store, tiers = make_tiered(tiny_tmpfs / "ssd", num_kv_pages=8, host_pages=8)
    with caplog.at_level(logging.WARNING, logger="backend.cache.ssd"):
        for i in range(3):
            assert run_request(store, tiers, pages(60 + i, 70 + i)) is not None
            tiers.drain()
    assert tiers.stats.disk_full_events >= 1 and tiers.ssd.disk_full
    assert tiers.stats.ssd_writes >= 1 and tiers.stats.writes_skipped_full >= 1
    assert sum("disk is full" in r.message or "no space" in r.message
               for r in caplog.records) == 1  # fmt: skip
    assert not list(tiny_tmpfs.glob("ssd/*.tmp"))  # failed writes left no temp files
    store.evict(6)
    _, served = run_request(store, tiers, pages(60, 70))
    assert served == 2
    tiers.assert_invariants()
    tiers.close()
