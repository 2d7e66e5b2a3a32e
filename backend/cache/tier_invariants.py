"""Invariants of `TieredBackend`, checked by `assert_invariants()` (tests call it after every
operation; the store's own invariants are checked too).

  N1  Every live tree node has a live entry pointing back at it; `by_hash` maps each live
      entry's prefix hash to it.
  N2  An off-device node's location is its fastest verified copy: HOST iff its DRAM copy is
      ready, else SSD iff its chunk is READY (a `lost` entry excepted).
  H1  A slot being filled (host_slot set, not ready) has a read in flight; a write in flight
      reads a ready slot. `host_lru` holds exactly the live entries with a slot.
  H2  DRAM accounting is exact: allocated slots == slots of live entries + slots of zombies
      + staged offload slots, with no slot held twice.
  S1  `ssd_lru` holds exactly the live entries with a READY chunk; a chunk being written is
      WRITING and belongs to an entry whose write is in flight.
  S2  SSD accounting is exact: used bytes == bytes of every chunk not yet deleted (entries,
      zombies, pending restores, deletes in flight); budget bytes exclude deletes in flight.
  P1  An entry's pins == its step pins + its layer-load holds.
  Z1  Zombies are dead and still busy (I/O or pins); live entries are not dead.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from backend.cache.base import Tier
from backend.cache.ssd import ChunkState
from backend.cache.tier_entry import OpKind

if TYPE_CHECKING:
    from backend.cache.tiers import TieredBackend


def check_tiers(tiers: TieredBackend) -> None:
    tiers.store.assert_invariants()
    live = []
    for node in tiers.store.tree.iter_nodes():
        e = node.tier_data
        assert e is not None and e.node is node and not e.dead, f"N1: {node!r} -> {e!r}"
        assert tiers.by_hash.get(e.prefix_hash) is e, f"N1: by_hash misses {e!r}"
        live.append(e)
        _check_entry(tiers, e)
    assert len(tiers.by_hash) == len(live), "N1: by_hash holds dead entries"
    for z in tiers.zombies:
        assert z.dead and not z.idle, f"Z1: {z!r}"
    _check_host(tiers, live)
    _check_ssd(tiers, live)
    _check_pins(tiers, live)


def _check_entry(tiers: TieredBackend, e) -> None:
    node = e.node
    if e.host_slot is not None and not e.host_ready:
        assert e.read is not None, f"H1: {e!r} filling without a read"
    if e.read is not None:
        assert e.host_slot is not None and not e.host_ready and e.read.kind == OpKind.READ
    if e.write is not None:
        assert e.host_ready and e.chunk is e.write.chunk, f"H1: {e!r}"
        assert e.chunk.state == ChunkState.WRITING, f"S1: {e!r}"
    elif e.chunk is not None:
        assert e.chunk.state == ChunkState.READY, f"S1: {e!r}"
    if node.on_device or e.lost:
        return
    want = Tier.HOST if e.host_ready else Tier.SSD if tiers.chunk_ready(e) else None
    assert node.kv_location == want, f"N2: {node!r} at {node.kv_location}, copies say {want}"


def _check_host(tiers: TieredBackend, live) -> None:
    with_slot = {e for e in live if e.host_slot is not None}
    assert set(tiers.host_lru) == with_slot, "H1: host_lru != live entries with a slot"
    slots = [e.host_slot for e in with_slot]
    slots += [z.host_slot for z in tiers.zombies if z.host_slot is not None]
    slots += list(tiers.staged.values())
    counts = Counter(slots)
    assert all(c == 1 for c in counts.values()), f"H2: slot held twice: {counts.most_common(2)}"
    allocated = tiers.host.slots.allocated_ids()
    assert allocated == set(slots), (
        f"H2: allocated={sorted(allocated)[:8]} held={sorted(slots)[:8]} "
        f"leaked={sorted(allocated - set(slots))[:5]}"
    )


def _check_ssd(tiers: TieredBackend, live) -> None:
    ready = {e for e in live if e.chunk is not None and e.chunk.state == ChunkState.READY}
    assert set(tiers.ssd_lru) == ready, "S1: ssd_lru != live entries with a READY chunk"
    if tiers.ssd is None:
        assert not any(e.chunk for e in live), "S1: chunks without an SSD tier"
        return
    chunks = [e.chunk for e in live if e.chunk is not None]
    chunks += [z.chunk for z in tiers.zombies if z.chunk is not None]
    chunks += [c for items in tiers.pending_restore.values() for c, _ in items]
    chunks += [op.chunk for op in tiers.inflight.values() if op.kind == OpKind.DELETE]
    assert len({id(c) for c in chunks}) == len(chunks), "S2: a chunk is held twice"
    used = sum(c.nbytes for c in chunks)
    deleting = sum(c.nbytes for c in chunks if c.state == ChunkState.DELETING)
    assert tiers.ssd.used_bytes == used, f"S2: used_bytes {tiers.ssd.used_bytes} != {used}"
    assert tiers.ssd.deleting_bytes == deleting, "S2: deleting_bytes"


def _check_pins(tiers: TieredBackend, live) -> None:
    holds = Counter({id(e): n for e, n in tiers.step_pins.items()})
    for _, entries in tiers._loads:
        holds.update(id(e) for e in entries)
    holds.update(id(e) for e, _ in tiers._deferred_loads)
    for e in [*live, *tiers.zombies]:
        assert e.pins == holds[id(e)], f"P1: {e!r} pins {e.pins} != holds {holds[id(e)]}"
