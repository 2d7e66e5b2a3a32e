"""Tiered KV store (PCR) figures on this machine's disk, with Qwen3.5-4B-shaped pages.

A page is 64 tokens x 32 KiB of KV (8 attention layers x K,V x 4 KV heads x 256 x bf16 =
2 MiB) plus its anchor block (8 groups x 4 anchors x 2560 x bf16 = 160 KiB).

  ssd_read_fraction_of_raw   SSD-tier read bandwidth (verified chunk reads on the I/O
                             thread pool into DRAM slots) / raw sequential O_DIRECT read
                             bandwidth of a file of the same size in the same directory
                             (4 MiB reads; the better of 1 stream and io_threads streams
                             over contiguous ranges); the two alternate for a few rounds
                             and the median ratio is reported.                goal >= 0.8
  prefetch_hidden_fraction   1 - (time requests spent in `wait_for` with prefetch) / (the
                             same without prefetch: their SSD read time), over a queue of
                             cold (SSD-only) requests, counting the requests whose time in
                             the look-ahead window exceeded their read time (the engine's
                             step is 1.5x one request's reads, so nearly all do).
                                                                             goal >= 0.9
  overlap_exposed_layers     time the model stalls in `load.start()` and `load.wait(a)` over
                             A = 8 attention
                             layers of a layer-wise load / one layer's transfer time; the
                             compute is a stand-in (sleep) of 1.5x a layer's transfer. The
                             end-to-end figure (overlapped time - compute alone) is reported
                             beside it, and the offload side (stall in `finish()`) as
                             overlap_offload_exposed_layers.                  goal <= 1.5
The page cache never flatters the SSD figures: every SSD read and write (tier and raw) uses
O_DIRECT where the filesystem accepts it (probed; `o_direct_used` in the summary), and
files are also dropped from the page cache with posix_fadvise(DONTNEED) before being read.

    python -m client.bench.tiers [--quick] [--dir DIR]
Writes client/bench/results/tiers/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from backend.cache import CacheConfig, PrefixStore
from backend.cache.chunk_format import ChunkHeader, Expected, fingerprint_hash, prefix_hash
from backend.cache.file_io import probe_kvikio, probe_o_direct
from backend.cache.host_pool import HostPool, aligned_empty
from backend.cache.io_pool import IOPool, Priority
from backend.cache.overlap import LayerwiseLoad, LayerwiseOffload, TransferThread
from backend.cache.page_io import DeviceBuffers
from backend.cache.ssd import SsdStore
from backend.cache.tier_config import TierConfig
from backend.cache.tier_stats import TierStats
from backend.cache.tiers import TieredBackend

RESULTS = Path(__file__).resolve().parent / "results" / "tiers"
MIB = 1 << 20
RAW_BLOCK = 4 * MIB
GOALS = {
    "ssd_read_fraction_of_raw": (">=", 0.8),
    "prefetch_hidden_fraction": (">=", 0.9),
    "overlap_exposed_layers": ("<=", 1.5),
}
# Qwen3.5-4B: 8 full-attention layers, 4 KV heads of 256, hidden 2560, 8 groups, bf16.
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, GROUPS, PAGE, ANCHORS = 8, 4, 256, 2560, 8, 64, 4
FINGERPRINT = "bench:qwen3.5-4b-shaped"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (about a minute)")
    p.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    args = p.parse_args(argv)
    args.bw_pages = 256 if args.quick else 1024  # 0.55 / 2.2 GiB
    args.bw_rounds = 5 if args.quick else 9
    args.num_requests, args.request_pages = (16, 8) if args.quick else (32, 16)
    args.overlap_pages, args.repeats = (128, 7) if args.quick else (256, 9)
    return args


def make_buffers(num_pages: int) -> DeviceBuffers:
    rows = num_pages * PAGE
    k = [torch.zeros(rows, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(rows, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    anchors = torch.zeros(GROUPS, num_pages * ANCHORS, HIDDEN, dtype=torch.bfloat16)
    return DeviceBuffers(k, v, PAGE, anchors, ANCHORS)


# Bandwidth -------------------------------------------------------------------------------
def write_raw_file(directory: Path, nbytes: int, block: int, o_direct: bool) -> Path:
    path = directory / "raw.bin"
    buf = aligned_empty(block)
    buf.fill_(7)
    flags = os.O_DIRECT if o_direct else 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flags, 0o600)
    for off in tqdm(range(0, nbytes, block), desc="raw write", unit="blk", leave=False):
        os.pwrite(fd, memoryview(buf.numpy()), off)
    os.fsync(fd)
    os.close(fd)
    return path


def raw_read_bandwidth(path: Path, nbytes: int, block: int, o_direct: bool, streams: int):
    """Sequential `block` reads of the file (O_DIRECT if available) by `streams` threads,
    each over a contiguous range; B/s."""
    offsets = list(range(0, nbytes, block))
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if o_direct else 0))
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    parts = [offsets[i * len(offsets) // streams : (i + 1) * len(offsets) // streams]
             for i in range(streams)]  # fmt: skip

    def read_part(part: list[int]) -> None:
        mine = aligned_empty(block)
        for off in part:
            os.preadv(fd, [memoryview(mine.numpy())], off)

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(read_part, parts))
    elapsed = time.perf_counter() - start
    os.close(fd)
    return len(offsets) * block / elapsed


def write_tier_chunks(directory: Path, num_pages: int, threads: int):
    """Writes `num_pages` chunks through the SSD tier; returns what reading them needs."""
    layout = make_buffers(1).layout
    stats, pool = TierStats(), IOPool(threads)
    fp = fingerprint_hash(FINGERPRINT)
    ssd = SsdStore(directory / "tier", 1 << 40, layout, fp, pool, stats)
    host = HostPool(layout, num_pages, pin=False)
    chunks, wants = [], []
    for i in tqdm(range(num_pages), desc="tier write", unit="page", leave=False):
        host.kv[i].fill_(i % 251)
        host.anchors[i].fill_(i % 13)
        tokens = torch.arange(i * PAGE, (i + 1) * PAGE, dtype=torch.int32).numpy().tobytes()
        ph = prefix_hash(b"\0" * 16, tokens)
        h = ChunkHeader(fp, b"\0" * 16, ph, b"\0" * 16, 0, PAGE, layout.kv_bytes,
                        layout.anchor_bytes, 0, layout.describe(), tokens)  # fmt: skip
        chunks.append(ssd.submit_write(h, host.payload(i), host.io_buffers(i)))
        wants.append(Expected(fp, b"\0" * 16, ph, tokens, layout.describe(),
                              layout.kv_bytes, layout.anchor_bytes))  # fmt: skip
    for chunk, fut in chunks:
        assert ssd.finish_write(chunk, fut), fut.exception()
    return ssd, host, [c for c, _ in chunks], wants


def tier_read_bandwidth(ssd: SsdStore, host: HostPool, chunks, wants) -> float:
    """Reads every chunk back (verified) on the I/O pool into DRAM slots, as a prefetch
    burst does; B/s of file bytes."""
    _drop_page_cache(ssd.dir)
    start = time.perf_counter()
    reads = [
        (
            chunk,
            ssd.submit_read(chunk, want, host.payload(i), host.io_buffers(i), Priority.PREFETCH),
        )  # fmt: skip
        for i, (chunk, want) in enumerate(zip(chunks, wants))
    ]
    for chunk, fut in tqdm(reads, desc="tier read", unit="page", leave=False):
        assert ssd.finish_read(chunk, fut), fut.exception()
    return len(chunks) * ssd.chunk_bytes / (time.perf_counter() - start)


def bandwidth(root: Path, args: argparse.Namespace, o_direct: bool) -> dict[str, Any]:
    """Tier and raw reads of the same bytes, alternated `repeats` times (the disk's speed
    drifts); the ratio is the median of the per-round ratios."""
    ssd, host, chunks, wants = write_tier_chunks(root, args.bw_pages, args.io_threads)
    nbytes = len(chunks) * ssd.chunk_bytes
    raw_file = write_raw_file(root, nbytes, RAW_BLOCK, o_direct)
    rounds = []
    for _ in tqdm(range(args.bw_rounds), desc="bandwidth rounds", leave=False):
        tier = tier_read_bandwidth(ssd, host, chunks, wants)
        raw = {n: raw_read_bandwidth(raw_file, nbytes, RAW_BLOCK, o_direct, n)
               for n in (1, args.io_threads)}  # fmt: skip
        rounds.append({"tier": tier, "raw": raw, "ratio": tier / max(raw.values())})
    ssd.pool.close()
    shutil.rmtree(ssd.dir)
    raw_file.unlink()
    return {
        "ssd_read_fraction_of_raw": statistics.median(r["ratio"] for r in rounds),
        "tier_read_MiB_s": statistics.median(r["tier"] for r in rounds) / MIB,
        "raw_read_MiB_s_by_streams": {
            n: statistics.median(r["raw"][n] for r in rounds) / MIB for n in rounds[0]["raw"]
        },
        "ratio_by_round": [r["ratio"] for r in rounds],
        "bytes_per_read": nbytes,
        "chunk_bytes": ssd.chunk_bytes,
        "io_threads": args.io_threads,
        "raw_block_MiB": RAW_BLOCK // MIB,
        "o_direct_used": ssd.io.o_direct,
    }


def _drop_page_cache(directory: Path) -> None:
    for path in directory.glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


# Prefetch --------------------------------------------------------------------------------
def _request_tokens(r: int, num_pages: int) -> list[int]:
    return list(range(r * 1_000_000, r * 1_000_000 + num_pages * PAGE))


def _tiered(directory: Path, num_kv_pages: int, host_pages: int, prefetch: bool, threads: int):
    cfg = TierConfig(
        host_pages=host_pages,
        ssd_path=directory,
        enable_prefetch=prefetch,
        enable_overlap=False,
        model_fingerprint=FINGERPRINT,
        io_threads=threads,
    )
    tiers = TieredBackend(cfg, make_buffers(num_kv_pages))
    cache = CacheConfig(
        page_size=PAGE,
        num_kv_pages=num_kv_pages,
        num_checkpoint_slots=0,
        anchor_density=ANCHORS / PAGE,
    )
    return PrefixStore(cache, tiers), tiers


def fill_cold_cache(directory: Path, args: argparse.Namespace) -> None:
    """Caches the requests' pages, then shuts down: a restart finds them on SSD only."""
    k = args.request_pages
    store, tiers = _tiered(directory, 2 * k, 2 * k, True, args.io_threads)
    for r in tqdm(range(args.num_requests), desc="fill SSD", unit="req", leave=False):
        alloc = store.alloc_pages(k)
        for page in alloc.kv_pages:
            rows = slice(page * PAGE, (page + 1) * PAGE)
            for t in (*tiers.buffers.k, *tiers.buffers.v):
                t[rows].fill_(r)
        res = store.insert(_request_tokens(r, k), None, alloc.kv_pages, alloc.anchor_blocks)
        store.free_pages(res.duplicate_kv_pages, res.duplicate_anchor_blocks)
        tiers.drain()
    tiers.close()
    _drop_page_cache(directory)


def serve_queue(directory: Path, args, prefetch: bool, step_s: float) -> dict[str, Any]:
    """Serves the queued cold requests one per step. Per request: seconds in `wait_for`
    (exposed SSD time) and seconds it spent in the look-ahead window before being
    scheduled (its queue wait while prefetchable)."""
    k, w = args.request_pages, 6
    store, tiers = _tiered(directory, 2 * k, (w + 2) * k, prefetch, args.io_threads)
    waiting = [(r, _request_tokens(r, k)) for r in range(args.num_requests)]
    entered: dict[int, float] = {}
    exposed, window_wait = [], []

    def update() -> None:
        now = time.perf_counter()
        for r, _ in waiting[:w]:
            entered.setdefault(r, now)
        tiers.prefetcher.update([(tokens, None) for _, tokens in waiting])

    update()
    time.sleep(step_s)  # the engine is busy when the queue forms
    for _ in tqdm(range(len(waiting)), desc=f"serve (prefetch={prefetch})", leave=False):
        update()
        r, tokens = waiting.pop(0)
        match = store.match_prefix(tokens)
        start = time.perf_counter()
        usable = tiers.prefetcher.wait_for(match.nodes)
        exposed.append(time.perf_counter() - start)
        window_wait.append(start - entered[r])
        assert usable == k, f"only {usable} of {k} pages usable"
        store.lock(match.nodes)
        assert store.promote(match.nodes)
        store.unlock(match.nodes)
        time.sleep(step_s)  # this request's forward
    stats = tiers.stats
    out = {
        "exposed_s": exposed,
        "window_wait_s": window_wait,
        "ssd_read_s": stats.ssd_read_seconds,
        "hits": stats.prefetch_hits,
        "late": stats.prefetch_late,
        "misses": stats.prefetch_misses,
    }
    tiers.close()
    _drop_page_cache(directory)
    return out


def hidden_fraction(cold: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """Share of SSD read time hidden, over the requests whose time in the look-ahead window
    exceeded their read time (their wait_for time without prefetch), and over all."""
    pairs = list(zip(cold["exposed_s"], warm["exposed_s"], warm["window_wait_s"]))
    eligible = [(read, left) for read, left, queued in pairs if queued >= read]
    return {
        "prefetch_hidden_fraction": 1 - sum(x[1] for x in eligible) / sum(x[0] for x in eligible),
        "eligible_requests": len(eligible),
        "all_requests_hidden_fraction": 1 - sum(warm["exposed_s"]) / sum(cold["exposed_s"]),
    }


# Overlap ---------------------------------------------------------------------------------
def overlap_exposure(args: argparse.Namespace) -> dict[str, Any]:
    """Exposed transfer time of layer-wise load and offload, in layers' transfer times,
    for compute stand-ins of 1.0x, 1.5x (the headline) and 2.0x one layer's transfer.
    Each repeat measures its own transfer time, compute-alone time and overlapped time
    back to back (the CPU's memcpy speed drifts with other load), then takes the median."""
    buffers = make_buffers(args.overlap_pages)
    host = HostPool(buffers.layout, args.overlap_pages, pin=False)
    host.kv.fill_(3)
    items = [(i, i) for i in range(args.overlap_pages)]
    worker = TransferThread("bench-load")

    def layer_time() -> float:
        start = time.perf_counter()
        LayerwiseLoad(buffers, host, worker, items).start().wait_all()
        return (time.perf_counter() - start) / LAYERS

    t_layers = [layer_time() for _ in range(3)]
    by_ratio = {}
    for ratio in (1.0, 1.5, 2.0):
        loads, offloads = [], []
        for _ in tqdm(range(args.repeats), desc=f"overlap x{ratio}", leave=False):
            t_layer = layer_time()
            t_layers.append(t_layer)
            compute = ratio * t_layer
            alone = _timed_layers(compute)  # the compute stand-in without transfers
            start = time.perf_counter()
            load = StallClock(LayerwiseLoad(buffers, host, worker, items).start().wait)
            load.stalled = time.perf_counter() - start  # start() copies layer 0 itself
            spent = _timed_layers(compute, load) + load.stalled
            loads.append((load.stalled / t_layer, (spent - alone) / t_layer))
            offload = LayerwiseOffload(buffers, host, worker, items)
            finish = StallClock(lambda _, offload=offload: offload.finish())
            spent = _timed_layers(compute, None, offload.layer_done, partial(finish, None))
            offloads.append((finish.stalled / t_layer, (spent - alone) / t_layer))
        by_ratio[ratio] = {
            "load_exposed_layers": statistics.median(x[0] for x in loads),
            "offload_exposed_layers": statistics.median(x[0] for x in offloads),
            "load_end_to_end_layers": statistics.median(x[1] for x in loads),
            "offload_end_to_end_layers": statistics.median(x[1] for x in offloads),
        }
    worker.close()
    return {
        "layer_transfer_ms": statistics.median(t_layers) * 1e3,
        "layer_transfer_ms_range": [min(t_layers) * 1e3, max(t_layers) * 1e3],
        "layer_MiB": args.overlap_pages * buffers.layout.layer_bytes / MIB,
        "compute_over_transfer": by_ratio,
        "overlap_exposed_layers": by_ratio[1.5]["load_exposed_layers"],
        "overlap_offload_exposed_layers": by_ratio[1.5]["offload_exposed_layers"],
        "sync_exposed_layers": float(LAYERS),
    }


class StallClock:
    """Wraps a blocking hook (`load.wait`, `offload.finish`) and sums the time the model
    spends stalled in it: the exposed transfer time."""

    def __init__(self, hook) -> None:
        self.hook, self.stalled = hook, 0.0

    def __call__(self, layer) -> None:
        start = time.perf_counter()
        self.hook(layer)
        self.stalled += time.perf_counter() - start


def _timed_layers(compute: float, before=None, after=None, finish=None) -> float:
    """Seconds for LAYERS layers of `compute` (a sleep: the model's kernels), with the
    layer-wise hooks the model calls before and after each attention layer."""
    start = time.perf_counter()
    for layer in range(LAYERS):
        if before is not None:
            before(layer)
        time.sleep(compute)
        if after is not None:
            after(layer)
    if finish is not None:
        finish()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the benchmark's own fills; tier copies are plain memcpys
    root = Path(tempfile.mkdtemp(prefix="tiers-bench-", dir=args.dir))
    try:
        o_direct = probe_o_direct(root)
        bw = bandwidth(root, args, o_direct)
        step_s = 1.5 * args.request_pages * bw["chunk_bytes"] / (bw["tier_read_MiB_s"] * MIB)
        fill_cold_cache(root / "ssd", args)
        cold = serve_queue(root / "ssd", args, prefetch=False, step_s=step_s)
        warm = serve_queue(root / "ssd", args, prefetch=True, step_s=step_s)
        hidden = hidden_fraction(cold, warm)
        overlap = overlap_exposure(args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "ssd_read_fraction_of_raw": bw["ssd_read_fraction_of_raw"],
        "prefetch_hidden_fraction": hidden["prefetch_hidden_fraction"],
        "overlap_exposed_layers": overlap["overlap_exposed_layers"],
        "overlap_offload_exposed_layers": overlap["overlap_offload_exposed_layers"],
        "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
        "page_cache": "O_DIRECT for every SSD read and write (tier and raw) where the "
        "filesystem accepts it, plus posix_fadvise(DONTNEED) on every file before reads",
        "o_direct_used": bw["o_direct_used"] and o_direct,
        "kvikio": probe_kvikio()._asdict(),
        "bandwidth": bw,
        "prefetch": {
            **hidden,
            "without": cold,
            "with": warm,
            "step_s": step_s,
            "window": 6,
            "requests": args.num_requests,
            "pages_per_request": args.request_pages,
        },
        "overlap": overlap,
        "page": {
            "kv_bytes": make_buffers(1).layout.kv_bytes,
            "chunk_bytes": bw["chunk_bytes"],
            "layout": make_buffers(1).layout._asdict(),
        },
        "quick": args.quick,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    for key, (op, goal) in GOALS.items():
        value = summary[key]
        ok = value >= goal if op == ">=" else value <= goal
        print(f"{key:28s} {value:8.3f}   goal {op} {goal}   {'ok' if ok else 'MISSED'}")
    print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
