"""TieredBackend: demote / promote round trips through DRAM and SSD are bit-identical, the
DRAM LRU makes room the documented way, offloaded copies are adopted at insert, and bad
configurations are refused."""

from __future__ import annotations

import pytest
import torch
from tier_helpers import (
    assert_page_served,
    make_buffers,
    make_tiered,
    pages,
    run_request,
)

from backend.cache.base import Tier
from backend.cache.page_io import DeviceBuffers
from backend.cache.tier_config import TierConfig


@pytest.fixture
def ssd_dir(tmp_path):
    return tmp_path / "ssd"


def _serve_again(store, tiers, tokens, salt=""):
    out = run_request(store, tiers, tokens, salt)
    assert out is not None
    tiers.assert_invariants()
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_round_trip_through_dram_is_bit_identical(overlap):
    store, tiers = make_tiered(None, num_kv_pages=8, host_pages=8, enable_overlap=overlap)
    tokens = pages(1, 2, 3)
    run_request(store, tiers, tokens)
    assert store.evict(3) == 3
    match = store.match_prefix(tokens)
    assert [n.kv_location for n in match.nodes] == [Tier.HOST] * 3
    tiers.assert_invariants()
    _, num_served = _serve_again(store, tiers, tokens)
    assert num_served == 3 and tiers.stats.promotes_from_host == 3
    tiers.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_round_trip_through_ssd_is_bit_identical(ssd_dir, overlap):
    store, tiers = make_tiered(ssd_dir, num_kv_pages=8, host_pages=3, enable_overlap=overlap)
    first, second = pages(1, 2, 3), pages(7, 8, 9)
    run_request(store, tiers, first)
    run_request(store, tiers, second)
    tiers.drain()
    assert tiers.stats.ssd_writes == 6
    store.evict(6)
    tiers.drain()
    locations = [n.kv_location for n in store.match_prefix(first).nodes]
    assert Tier.SSD in locations
    tiers.assert_invariants()
    _, num_served = _serve_again(store, tiers, first)
    assert num_served == 3
    assert tiers.stats.ssd_reads >= 1 and tiers.stats.ssd_bytes_read > 0
    assert tiers.stats.promotes_from_host == 3  # wait_for staged the SSD pages in DRAM
    tiers.close()


def test_dram_only_drops_leaves_when_full():
    store, tiers = make_tiered(None, num_kv_pages=4, host_pages=2)
    run_request(store, tiers, pages(1, 2))
    run_request(store, tiers, pages(5, 6))
    assert store.evict(4) == 4  # two fit in DRAM; the DRAM LRU leaf goes to make room
    tiers.assert_invariants()
    assert tiers.stats.pages_dropped >= 1 and tiers.stats.host_demotions == 4
    assert store.num_cached_pages == 2
    tiers.close()


def test_dram_victim_without_ssd_copy_is_written_to_ssd_first(ssd_dir):
    store, tiers = make_tiered(ssd_dir, num_kv_pages=4, host_pages=1)
    budget, tiers.ssd.budget_bytes = tiers.ssd.budget_bytes, 0  # no write-back at insert
    run_request(store, tiers, pages(1, 2))
    tiers.ssd.budget_bytes = budget
    assert tiers.stats.ssd_writes == 0 and tiers.stats.writes_skipped_full == 2
    # Page 2 leaves the device into DRAM's only slot (its staging copy); then page 1 needs
    # that slot, and page 2 has no other copy: it is written to SSD before its slot goes.
    assert store.evict(2) == 2
    assert tiers.stats.ssd_demotions == 1
    tiers.drain()
    tiers.assert_invariants()
    locations = [n.kv_location for n in store.match_prefix(pages(1, 2)).nodes]
    assert locations == [Tier.HOST, Tier.SSD]
    _serve_again(store, tiers, pages(1, 2))
    tiers.close()


def test_demote_to_ssd_when_no_dram_slot_can_be_freed(ssd_dir):
    store, tiers = make_tiered(ssd_dir, num_kv_pages=4, host_pages=1)
    run_request(store, tiers, pages(1))
    tiers.drain()
    run_request(store, tiers, pages(1, 2))
    tiers.drain()
    run_request(store, tiers, pages(5))  # its staging copy takes DRAM's only slot
    tiers.drain()
    busy = tiers.entry(store.match_prefix(pages(5)).nodes[0])
    tiers.pin_for_step(busy)  # ... and a scheduled request holds it
    assert store.evict(1) == 1  # page 2 (least recent leaf) cannot get a DRAM slot
    leaf = store.match_prefix(pages(1, 2)).nodes[1]
    assert leaf.kv_location == Tier.SSD and tiers.stats.host_demotions == 0
    tiers.begin_step()
    tiers.assert_invariants()
    tiers.close()


def test_offloaded_copies_are_adopted_without_another_copy(ssd_dir):
    store, tiers = make_tiered(ssd_dir, num_kv_pages=8, host_pages=8, enable_overlap=True)
    run_request(store, tiers, pages(1, 2, 3))
    assert tiers.stats.layer_offloads == 1 and tiers.stats.host_staged == 3
    assert not tiers.staged
    tiers.drain()
    assert tiers.stats.ssd_writes == 3
    tiers.assert_invariants()
    tiers.close()


def test_freed_duplicates_release_their_staged_slots():
    store, tiers = make_tiered(None, num_kv_pages=8, host_pages=8, enable_overlap=True)
    alloc = store.alloc_pages(2)
    offload = tiers.start_layer_offload(alloc.kv_pages)
    offload.finish()
    assert len(tiers.staged) == 2
    store.free_pages(alloc.kv_pages, alloc.anchor_blocks)
    assert not tiers.staged and tiers.host.num_free == 8
    tiers.assert_invariants()
    tiers.close()


def test_unloaded_promotion_is_an_integration_error():
    store, tiers = make_tiered(None, num_kv_pages=4, host_pages=4, enable_overlap=True)
    run_request(store, tiers, pages(1))
    store.evict(1)
    match = store.match_prefix(pages(1))
    store.lock(match.nodes)
    assert store.promote(match.nodes)
    alloc = store.alloc_pages(1)
    with pytest.raises(RuntimeError, match="start_layer_load"):
        store.insert(pages(1, 2), None, [match.nodes[0].kv_page, *alloc.kv_pages],
                     [match.nodes[0].anchor_block, *alloc.anchor_blocks])  # fmt: skip
    tiers.finish_loads()
    assert_page_served(tiers, match.nodes[0], pages(1))
    store.unlock(match.nodes)
    tiers.close()


def test_tier_config_is_validated(tmp_path):
    assert not TierConfig().uses_ssd  # no directory: DRAM only
    assert not TierConfig(ssd_path=tmp_path, enable_ssd=False).uses_ssd
    with pytest.raises(ValueError, match="model_fingerprint"):
        TierConfig(ssd_path=tmp_path)
    with pytest.raises(ValueError, match="io_threads"):
        TierConfig(enable_ssd=False, io_threads=0)
    with pytest.raises(ValueError, match="host_pages"):
        TierConfig(ssd_path=tmp_path, model_fingerprint="m", host_pages=0)
    cfg = TierConfig(ssd_path=tmp_path, model_fingerprint="m", enable_prefetch=False)
    assert cfg.uses_ssd and not cfg.uses_prefetch


def test_model_fingerprint_changes_with_weights_and_dtype(tmp_path):
    from backend.cache.tier_config import fingerprint_model_dir

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights-a")
    a = fingerprint_model_dir(tmp_path, "bfloat16")
    assert a == fingerprint_model_dir(tmp_path, "bfloat16")
    assert a != fingerprint_model_dir(tmp_path, "float32")
    (tmp_path / "model.safetensors").write_bytes(b"weights-b")
    assert a != fingerprint_model_dir(tmp_path, "bfloat16")


def test_device_buffers_check_shapes_and_build_from_an_executor():
    with pytest.raises(ValueError, match="whole number"):
        DeviceBuffers([torch.zeros(6, 2, 8)], [torch.zeros(6, 2, 8)], page_size=4)
    with pytest.raises(ValueError, match="Hkv"):
        DeviceBuffers([torch.zeros(8, 2, 8)], [torch.zeros(8, 2, 4)], page_size=4)

    class Executor:  # the two attributes the tiers read
        kv = type("KV", (), {})()

    buffers = make_buffers(4)
    Executor.kv.k, Executor.kv.v, Executor.kv.page_size = buffers.k, buffers.v, 4
    Executor.anchors = buffers.anchors
    built = DeviceBuffers.from_executor(Executor, anchors_per_page=1)
    assert built.layout == buffers.layout and built.num_anchor_blocks == 4
    assert built.layout.kv_bytes == 3 * 2 * 4 * 2 * 8 * 4


def test_store_and_buffers_must_agree(ssd_dir):
    from backend.cache import CacheConfig, PrefixStore
    from backend.cache.tiers import TieredBackend

    tiers = TieredBackend(TierConfig(enable_ssd=False, host_pages=2), make_buffers(4))
    with pytest.raises(ValueError, match="page_size"):
        PrefixStore(CacheConfig(page_size=8, num_kv_pages=4, anchor_density=1 / 8), tiers)
    with pytest.raises(ValueError, match="anchors"):
        PrefixStore(CacheConfig(page_size=4, num_kv_pages=4, policy="checkpoint"), tiers)
    tiers.close()


def test_a_partly_promoted_path_keeps_only_its_device_part_locked():
    """The device is full of pages a running request holds: admission keeps the matched
    pages already on the device, unlocks the rest and recomputes from there."""
    from backend.cache.config import CacheConfig
    from backend.engine.cache_manager import CacheManager
    from backend.engine.config import EngineConfig
    from backend.replay.budget import ReplayConfig

    store, tiers = make_tiered(num_kv_pages=4, host_pages=8)
    a, b = pages(1, 2, 3), pages(4, 5, 6)
    run_request(store, tiers, a)
    b_nodes, _ = run_request(store, tiers, b)  # evicts a's two deepest pages to DRAM
    store.lock(b_nodes)  # b is running: its pages cannot leave the device
    config = EngineConfig(cache=CacheConfig(page_size=4, anchor_density=1 / 4, num_kv_pages=4),
                          replay=ReplayConfig(anchor_density=1 / 4))
    manager = CacheManager(config, store, None, tiers)
    match = store.match_prefix(a, "")
    assert [n.on_device for n in match.nodes] == [True, False, False]
    nodes = manager._usable_prefix(match)
    assert nodes == match.nodes[:1] and nodes[0].lock_ref == 1
    assert all(n.lock_ref == 0 for n in match.nodes[1:])
    store.unlock(nodes)
    store.unlock(b_nodes)
    store.assert_invariants()
