"""Checkpoint states below the device slots (`backend/cache/state_tier.py`): a checkpoint
whose device slot is reclaimed is kept in DRAM, then on SSD, and comes back bit for bit;
a bad copy is a miss, never a wrong state."""

from __future__ import annotations

import pytest
import torch
import xxhash
from tier_helpers import hold_io

from backend.cache import CacheConfig, PrefixStore
from backend.cache.chunk_format import ChunkHeader, fingerprint_hash, pack_header, prefix_hash
from backend.cache.page_io import DeviceBuffers
from backend.cache.tier_config import TierConfig
from backend.cache.tiers import TieredBackend
from backend.model.kv_cache import StateSlots

PAGE, LAYERS, HEADS, HEAD_DIM = 4, 2, 2, 8
LINEAR, HV, DK, DV, CONV, W = 3, 2, 4, 4, 12, 3


def _slots(n: int) -> StateSlots:
    return StateSlots(conv=[torch.zeros(n, CONV, W) for _ in range(LINEAR)],
                      rec=[torch.zeros(n, HV, DK, DV) for _ in range(LINEAR)])


def _state_of(tokens) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a forward leaves in the linear layers after `tokens` (a pure function of them)."""
    seed = xxhash.xxh3_64_intdigest(repr(list(tokens)).encode()) % (2**63)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(CONV, W, generator=g), torch.randn(HV, DK, DV, generator=g))
            for _ in range(LINEAR)]


def _make(tmp_path=None, device_slots=1, host_slots=2, ssd_slots=0, kv_pages=32, **kw):
    rows = kv_pages * PAGE
    k = [torch.zeros(rows, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v = [torch.zeros(rows, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    buffers = DeviceBuffers(k, v, PAGE, states=_slots(device_slots))
    ssd = tmp_path is not None and ssd_slots > 0
    cfg = TierConfig(host_pages=kv_pages, ssd_path=str(tmp_path) if ssd else None,
                     enable_ssd=ssd, model_fingerprint="m", io_threads=2, enable_overlap=False,
                     host_checkpoint_slots=host_slots, ssd_checkpoint_slots=ssd_slots, **kw)
    tiers = TieredBackend(cfg, buffers)
    store = PrefixStore(CacheConfig(page_size=PAGE, policy="checkpoint", checkpoint_interval=PAGE,
                                    num_kv_pages=kv_pages, num_checkpoint_slots=device_slots,
                                    anchor_density=1 / PAGE,
                                    lookahead_window=2), tiers)
    return store, tiers


def _cache(store, tiers, tokens, salt=""):
    """Caches `tokens` (whole pages) with its state at the end, as a finished prefill does."""
    n = len(tokens) // PAGE
    kv = store.alloc_pages(n).kv_pages
    slot = store.alloc_state_slots(1)[0]
    tiers.buffers.states.write(slot, _state_of(tokens))
    result = store.insert(tokens, salt, kv, (), {n * PAGE: slot})
    store.free_pages(result.duplicate_kv_pages)
    store.free_state_slots(result.duplicate_state_slots)
    return result.nodes


def _load(store, tiers, tokens, salt=""):
    """Matches `tokens` and loads the checkpoint's state from wherever it is; returns
    (pages resumed, the state or None)."""
    match = store.match_prefix(tokens, salt)
    if match.checkpoint is None:
        return 0, None
    dst = _slots(1)
    if match.checkpoint.slot is not None:
        dst.write(0, tiers.buffers.states.read(match.checkpoint.slot))
    elif not tiers.load_state(match.checkpoint.node, dst, 0):
        return 0, None
    return match.num_matched_pages, dst.read(0)


def _assert_state(got, tokens):
    for (c, r), (wc, wr) in zip(got, _state_of(tokens)):
        assert torch.equal(c, wc) and torch.equal(r, wr), "a restored state differs"


A, B, C = (list(range(s, s + 3 * PAGE)) for s in (100, 200, 300))


def test_a_reclaimed_checkpoint_comes_back_from_dram():
    store, tiers = _make(device_slots=1, host_slots=2)
    _cache(store, tiers, A)
    _cache(store, tiers, B)  # takes A's only device slot: A's state goes to DRAM
    pages, state = _load(store, tiers, A)
    assert pages == 3
    _assert_state(state, A)
    assert tiers.stats.state_spills == 1 and tiers.stats.state_loads_host == 1
    store.assert_invariants()
    tiers.assert_invariants()


def test_without_state_slots_below_the_device_the_checkpoint_is_lost():
    store, tiers = _make(device_slots=1, host_slots=0)
    _cache(store, tiers, A)
    _cache(store, tiers, B)
    assert _load(store, tiers, A) == (0, None)
    assert store.match_prefix(A).num_cached_pages == 3  # its KV pages stay, useless alone


def test_dram_victims_stay_on_ssd_and_prefetch_brings_them_back(tmp_path):
    store, tiers = _make(tmp_path, device_slots=1, host_slots=1, ssd_slots=8)
    _cache(store, tiers, A)
    _cache(store, tiers, B)  # A -> DRAM (+ file)
    tiers.drain()
    _cache(store, tiers, C)  # B -> DRAM: A leaves DRAM, stays on SSD
    tiers.drain()
    node = store.match_prefix(A).checkpoint.node
    assert tiers.states.location(node).name == "SSD"
    started = tiers.prefetcher.update([(A, "")])
    assert tiers.stats.state_prefetch_started == 1, started
    tiers.drain()
    pages, state = _load(store, tiers, A)
    assert pages == 3
    _assert_state(state, A)
    assert tiers.stats.state_prefetch_hits == 1 and tiers.stats.ssd_reads >= 1
    tiers.assert_invariants()
    tiers.close()


def test_a_queued_request_waits_for_its_state_read_not_the_engine(tmp_path):
    """A's pages are on the device, its state only on SSD: `reads_pending` starts that read
    (a prefetch) and reports it while the disk holds it; once read, the state loads from
    DRAM."""
    store, tiers = _make(tmp_path, device_slots=1, host_slots=1, ssd_slots=8)
    for tokens in (A, B, C):
        _cache(store, tiers, tokens)
        tiers.drain()
    assert tiers.states.location(store.match_prefix(A).checkpoint.node).name == "SSD"
    gate = hold_io(tiers, threads=2)
    assert tiers.prefetcher.reads_pending(A, "", timeout=0.05)
    assert tiers.stats.state_prefetch_started == 1
    gate.set()
    assert not tiers.prefetcher.reads_pending(A, "", timeout=30)
    pages, state = _load(store, tiers, A)
    assert pages == 3
    _assert_state(state, A)
    assert tiers.stats.state_prefetch_hits == 1 and tiers.stats.state_prefetch_misses == 0
    assert tiers.stats.state_loads_host == 1
    tiers.close()


def test_an_ssd_only_state_is_read_on_demand(tmp_path):
    store, tiers = _make(tmp_path, device_slots=1, host_slots=1, ssd_slots=8)
    for tokens in (A, B, C):
        _cache(store, tiers, tokens)
        tiers.drain()
    pages, state = _load(store, tiers, A)  # no prefetch: a foreground read
    assert pages == 3
    _assert_state(state, A)
    assert tiers.stats.state_prefetch_misses == 1
    tiers.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_state_file_is_a_miss(tmp_path, damage):
    store, tiers = _make(tmp_path, device_slots=1, host_slots=1, ssd_slots=8)
    for tokens in (A, B, C):
        _cache(store, tiers, tokens)
        tiers.drain()
    files = {p.name.split(".")[0]: p for p in (tmp_path / "states").iterdir()}
    node_a = store.match_prefix(A).checkpoint.node
    path = files[tiers.entry(node_a).prefix_hash.hex()]
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:  # another prefix's valid file under A's name
        node_b = store.match_prefix(B).checkpoint.node
        data = files[tiers.entry(node_b).prefix_hash.hex()].read_bytes()
    path.write_bytes(bytes(data))
    assert _load(store, tiers, A) == (0, None)
    assert not tiers.has_state(node_a)
    reason = {"flip": "checksum", "truncate": "torn", "swap": "token_mismatch"}[damage]
    assert dict(tiers.stats.chunk_rejects) == {f"state_{reason}": 1}
    tiers.drain()
    assert not path.exists()
    tiers.assert_invariants()
    tiers.close()


def test_states_leave_with_their_pages_and_their_files(tmp_path):
    store, tiers = _make(tmp_path, device_slots=1, host_slots=1, ssd_slots=8, kv_pages=6)
    _cache(store, tiers, A)
    _cache(store, tiers, B)
    tiers.drain()
    # A third prompt needs the device pages; the DRAM KV tier is large, so A's pages demote.
    _cache(store, tiers, C)
    tiers.drain()
    assert tiers.has_state(store.match_prefix(A).checkpoint.node)
    for root in list(store.tree.roots.values()):
        for child in list(root.children.values()):
            if not child.on_device and not child.lock_ref:
                store.drop_subtree(child)
    tiers.drain()
    assert store.match_prefix(A).num_cached_pages == 0  # A's pages and state are gone
    kept = {tiers.entry(n).prefix_hash.hex() for n in tiers.states.entries}
    on_disk = {p.name.split(".")[0] for p in (tmp_path / "states").iterdir()}
    assert on_disk == kept
    tiers.assert_invariants()
    tiers.close()


def test_state_tier_parameters_are_checked(tmp_path):
    with pytest.raises(ValueError, match="host_checkpoint_slots must be >= 0"):
        TierConfig(host_checkpoint_slots=-1)
    with pytest.raises(ValueError, match="staged through DRAM"):
        TierConfig(ssd_path=str(tmp_path), model_fingerprint="m", ssd_checkpoint_slots=4)


def test_state_slots_below_the_device_need_a_policy_that_saves_states():
    from backend.engine.config import EngineConfig

    with pytest.raises(ValueError, match="not 'none'"):
        EngineConfig.from_params({"cache_policy": "none", "host_pages": "8",
                                  "host_checkpoint_slots": "4"})
    with pytest.raises(ValueError, match="num_checkpoint_slots must be >= 1"):
        EngineConfig.from_params({"cache_policy": "suffixreplay", "host_pages": "8",
                                  "host_checkpoint_slots": "4", "num_checkpoint_slots": "0"})
    with pytest.raises(ValueError, match="need live_state on"):
        EngineConfig.from_params({"cache_policy": "suffixreplay", "host_pages": "8",
                                  "host_checkpoint_slots": "4", "live_state": "false"})
    for policy in ("checkpoint", "suffixreplay"):
        config = EngineConfig.from_params({"cache_policy": policy, "host_pages": "8",
                                           "host_checkpoint_slots": "4",
                                           "max_cached_pages": "16"})
        assert config.tiers.host_checkpoint_slots == 4 and config.cache.max_cached_pages == 16


def _page_tokens(i: int) -> bytes:
    return bytes([i]) * (4 * PAGE)  # a root page's key: PAGE int32 token ids


def _write_state_files(tmp_path, names, fingerprint: str = "m") -> None:
    """State files of `names` (<prefix hash>.<seq>.st, the hash of a root page of
    `_page_tokens(i)`) as an engine of model `fingerprint` writes them (valid headers, zero
    states)."""
    _, tiers = _make(tmp_path / "probe", ssd_slots=1)
    states = tiers.states
    folder = tmp_path / "states"
    folder.mkdir(exist_ok=True)
    by_key = {prefix_hash(bytes(16), _page_tokens(i)): _page_tokens(i) for i in range(8)}
    for name in names:
        key = bytes.fromhex(name.split(".")[0])
        header = ChunkHeader(fingerprint_hash(fingerprint), bytes(16), key, bytes(16), 1, PAGE,
                             states.layout.nbytes, 0, 0, states.text, by_key[key],
                             states.header_len)
        (folder / name).write_bytes(pack_header(header) + bytes(states.layout.nbytes))
    tiers.close()


def test_start_up_keeps_the_newest_state_file_per_prefix_within_the_slot_limit(tmp_path):
    """An earlier run's state files: the newest per prefix hash, at most `ssd_slots` (newest
    first), wait for their nodes; older duplicates, files past the limit and strangers go."""
    folder = tmp_path / "states"
    keys = [prefix_hash(bytes(16), _page_tokens(i)) for i in range(4)]
    names = [f"{keys[0].hex()}.1.st", f"{keys[0].hex()}.7.st", f"{keys[1].hex()}.2.st",
             f"{keys[2].hex()}.5.st", f"{keys[3].hex()}.6.st"]
    _write_state_files(tmp_path, names)
    for n in ("junk.txt", f"{keys[1].hex()}.3.st.tmp"):
        (folder / n).write_bytes(b"x")
    _, tiers = _make(tmp_path, ssd_slots=3)
    states = tiers.states
    assert list(states.found) == [keys[2], keys[3], keys[0]]  # oldest first
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"{keys[0].hex()}.7.st", f"{keys[2].hex()}.5.st", f"{keys[3].hex()}.6.st"])
    assert states._seq == 7 and tiers.stats.restored_state_files == 3
    tiers.assert_invariants()


def test_start_up_leaves_another_models_state_files_alone(tmp_path):
    """Another model's files (by their headers) are neither indexed nor deleted nor counted
    against the slots; a damaged header is deleted."""
    keys = [prefix_hash(bytes(16), _page_tokens(i)) for i in range(4)]
    theirs = [f"{keys[0].hex()}.1.st", f"{keys[1].hex()}.2.st", f"{keys[2].hex()}.3.st"]
    _write_state_files(tmp_path, theirs, fingerprint="other")
    _write_state_files(tmp_path, [f"{keys[3].hex()}.4.st"])
    (tmp_path / "states" / f"{keys[0].hex()}.9.st").write_bytes(b"x" * 100)  # torn
    _, tiers = _make(tmp_path, ssd_slots=1)
    assert list(tiers.states.found) == [keys[3]]
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == sorted(
        [*theirs, f"{keys[3].hex()}.4.st"])
    assert tiers.stats.chunk_rejects["state_foreign_model"] == 3
    tiers.assert_invariants()
