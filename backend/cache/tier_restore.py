"""Warm restart: the SSD chunks found at start-up become SSD-resident tree nodes.

The salt never reaches the disk (headers hold its hash), so a namespace is restored when a
request first names it (`TierBackend.on_lookup`, called by match, protect and insert).
A chunk's header carries its page's token ids (the node key), its prefix hash and its
parent's, so pages are linked top-down: a first page hangs under the salt's root, a deeper
page under the restored or live node whose prefix hash is its parent hash. A chunk whose
parent is gone is an orphan (unreachable): deleted and counted. A restored page takes the
retention priority `retention.log` holds for it.
"""

from __future__ import annotations

from backend.cache.base import Tier
from backend.cache.chunk_format import ChunkHeader
from backend.cache.ssd import SsdChunk
from backend.cache.tier_entry import TierEntry


def restore_namespace(tiers, salt: str, items: list[tuple[SsdChunk, ChunkHeader]]) -> int:
    """Re-inserts namespace `salt`'s chunks; returns the number of new nodes."""
    tree = tiers.store.tree
    salt_hash = tiers.salt_hash(salt)
    restored: list[TierEntry] = []
    for chunk, h in sorted(items, key=lambda item: item[1].depth):
        ok = len(h.tokens) == tree.page_bytes
        parent = _parent(tiers, tree, salt, salt_hash, h) if ok else None
        if parent is None:
            tiers.stats.orphan_chunks += 1
            tiers.delete_chunk(chunk)
            continue
        node = parent.children.get(h.tokens)
        if node is not None:  # inserted since start-up: keep the chunk as its SSD copy
            e = tiers.entry(node)
            if e.chunk is None and e.prefix_hash == h.prefix_hash:
                e.chunk = chunk
                restored.append(e)
                tiers.sync_location(e)
                _adopt_state(tiers, node, e.prefix_hash)
            else:
                tiers.delete_chunk(chunk)
            continue
        node = tree.add_child(parent, h.tokens)
        node.kv_location = Tier.SSD
        node.anchor_location = Tier.SSD if tiers.uses_anchors else None
        e = TierEntry(node, h.prefix_hash, h.parent_hash)
        e.chunk = chunk
        node.tier_data = e
        tiers.by_hash[e.prefix_hash] = e
        restored.append(e)
        tiers.stats.restored_pages += 1
        _adopt_state(tiers, node, e.prefix_hash)
        _adopt_priority(tiers, node, e.prefix_hash)
    for e in sorted(restored, key=lambda e: e.chunk.seq):  # oldest write = least recent
        tiers.ssd_lru[e] = None
    return len(restored)


def _adopt_state(tiers, node, prefix_hash: bytes) -> None:
    """The checkpoint policy's saved state at this page, if an earlier run left its file."""
    if tiers.states is not None and tiers.states.adopt(node, prefix_hash):
        tiers.stats.restored_states += 1


def _adopt_priority(tiers, node, prefix_hash: bytes) -> None:
    """The retention priority a request gave this page in an earlier run, for the rest of
    its duration (`retention_log.py`)."""
    found = [] if tiers.retention_log is None else tiers.retention_log.grants(prefix_hash)
    for grant in found:  # the strongest first: the others wait behind it
        tiers.store.evictor.retain([node], [grant], log=False)
    if found:
        tiers.stats.restored_priorities += 1


def _parent(tiers, tree, salt: str, salt_hash: bytes, h: ChunkHeader):
    if h.depth == 0:
        return tree.root(salt, create=True) if h.parent_hash == salt_hash else None
    e = tiers.by_hash.get(h.parent_hash)
    if e is None or e.dead or e.node.depth != h.depth - 1:
        return None
    return e.node
