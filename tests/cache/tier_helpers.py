"""Builders for the tier tests: small device buffers, a tiered store, and "run one request"
the way the engine does it, with page contents that are a pure function of the page's
prefix so that any served page can be checked bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import xxhash

from backend.cache import CacheConfig, PrefixStore
from backend.cache.io_pool import Priority
from backend.cache.page_io import DeviceBuffers
from backend.cache.tier_config import TierConfig
from backend.cache.tiers import TieredBackend

PAGE = 4  # tokens per page
LAYERS, HEADS, HEAD_DIM = 3, 2, 8
GROUPS, HIDDEN = 2, 16


def make_buffers(num_pages: int, dtype=torch.float32, device="cpu") -> DeviceBuffers:
    rows = num_pages * PAGE
    k = [torch.zeros(rows, HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(LAYERS)]
    v = [torch.zeros(rows, HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(LAYERS)]
    anchors = torch.zeros(GROUPS, num_pages, HIDDEN, dtype=dtype, device=device)
    return DeviceBuffers(k, v, PAGE, anchors, anchors_per_page=1)


def make_tiered(
    ssd_dir=None,
    num_kv_pages: int = 8,
    host_pages: int = 4,
    io_pool=None,
    chunk_io=None,
    device="cpu",
    **overrides,
) -> tuple[PrefixStore, TieredBackend]:
    fields = dict(
        host_pages=host_pages,
        ssd_path=ssd_dir,
        ssd_bytes=1 << 30,
        enable_ssd=ssd_dir is not None,
        model_fingerprint="test-model",
        io_threads=2,
        enable_overlap=False,
    )
    fields.update(overrides)
    buffers = make_buffers(num_kv_pages, device=device)
    tiers = TieredBackend(TierConfig(**fields), buffers, io_pool=io_pool, chunk_io=chunk_io)
    cfg = CacheConfig(page_size=PAGE, anchor_density=1 / PAGE, num_kv_pages=num_kv_pages,
                      num_checkpoint_slots=0, lookahead_window=2)  # fmt: skip
    return PrefixStore(cfg, tiers), tiers


def hold_io(tiers: TieredBackend, threads: int) -> threading.Event:
    """Occupies the tiers' `threads` I/O threads until the returned event is set: reads
    submitted meanwhile stay queued, as behind a slow disk."""
    gate = threading.Event()
    running = [threading.Event() for _ in range(threads)]
    for started in running:
        tiers.io.submit(Priority.PREFETCH, lambda started=started: (started.set(), gate.wait(30)))
    assert all(started.wait(10) for started in running)
    return gate


def pages(*chunks: int) -> list[int]:
    return [c for c in chunks for _ in range(PAGE)]


def page_content(prefix_tokens: Sequence[int], salt: str = "") -> tuple[torch.Tensor, ...]:
    """KV `[A, 2, PAGE, H, Dh]` and anchors `[G, 1, D]` of the page ending the prefix."""
    seed = xxhash.xxh3_64_intdigest(repr((salt, list(prefix_tokens))).encode()) % (2**63)
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYERS, 2, PAGE, HEADS, HEAD_DIM, generator=g)
    anchor = torch.randn(GROUPS, 1, HIDDEN, generator=g)
    return kv, anchor


def write_page(buffers: DeviceBuffers, kv_page: int, block: int, prefix, salt="") -> None:
    """What a forward pass does: the page's KV and anchor rows land in the device buffers."""
    kv, anchor = page_content(prefix, salt)
    rows = slice(kv_page * PAGE, (kv_page + 1) * PAGE)
    for a in range(LAYERS):
        buffers.k[a][rows] = kv[a, 0]
        buffers.v[a][rows] = kv[a, 1]
    buffers.anchors[:, block : block + 1] = anchor


def read_page(buffers: DeviceBuffers, kv_page: int, block: int) -> tuple[torch.Tensor, ...]:
    rows = slice(kv_page * PAGE, (kv_page + 1) * PAGE)
    kv = torch.stack([torch.stack([buffers.k[a][rows], buffers.v[a][rows]]) for a in range(LAYERS)])
    return kv.cpu(), buffers.anchors[:, block : block + 1].to("cpu", copy=True)


def assert_page_served(tiers: TieredBackend, node, tokens, salt="") -> None:
    """The device copy of `node` is bit-identical to what was written for its prefix."""
    prefix = list(tokens[: (node.depth + 1) * PAGE])
    kv, anchor = page_content(prefix, salt)
    got_kv, got_anchor = read_page(tiers.buffers, node.kv_page, node.anchor_block)
    assert torch.equal(got_kv, kv), f"KV of {node!r} differs from what was written"
    assert torch.equal(got_anchor, anchor), f"anchors of {node!r} differ"


def run_request(store: PrefixStore, tiers: TieredBackend, tokens, salt="", check=True):
    """The engine's life of one request: match, wait_for, lock, promote, load, allocate,
    "forward" (write the new pages), offload, insert, unlock. Returns the inserted path,
    the number of pages served from the cache, or None when the device is full."""
    tiers.prefetcher.update([(tokens, salt)])  # the request waited in the queue
    match = store.match_prefix(tokens, salt)
    usable = tiers.prefetcher.wait_for(match.nodes)
    nodes = match.nodes[:usable]
    store.lock(nodes)
    if not store.promote(nodes):
        store.unlock(nodes)
        return None
    tiers.start_layer_load().wait_all()
    if check:
        for node in nodes:
            assert_page_served(tiers, node, tokens, salt)
    num_pages = len(tokens) // PAGE
    alloc = store.alloc_pages(num_pages - len(nodes))
    if alloc is None:
        store.unlock(nodes)
        return None
    offload = tiers.start_layer_offload(alloc.kv_pages)
    for i, (page, block) in enumerate(zip(alloc.kv_pages, alloc.anchor_blocks)):
        write_page(tiers.buffers, page, block, tokens[: (len(nodes) + i + 1) * PAGE], salt)
    for layer in range(LAYERS):
        offload.layer_done(layer)
    offload.finish()
    result = store.insert(
        tokens, salt,
        [n.kv_page for n in nodes] + alloc.kv_pages,
        [n.anchor_block for n in nodes] + alloc.anchor_blocks,
    )  # fmt: skip
    store.unlock(nodes)
    store.free_pages(result.duplicate_kv_pages, result.duplicate_anchor_blocks)
    return result.nodes, len(nodes)
