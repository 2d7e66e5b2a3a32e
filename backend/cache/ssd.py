"""`SsdStore`: the SSD tier's files, byte budget and I/O submission.

One file per page, `<dir>/<prefix_hash>.<seq>.kv` (format in `chunk_format.py`). Why not
packed segment files: a page is already large (a Qwen3.5-4B page is 2 MiB, so the per-file
create/rename/unlink cost is well under 1% of its transfer), one file per page makes every
write atomic by rename, a freed page is an `unlink` (segments would need compaction and a
free-space map), and the start-up scan is one header read per file. One flat directory, not
hash-sharded subdirectories: ext4 and XFS index large directories (htree / B+tree), and files
written one after another into one directory are allocated near each other, so reading a
prefix's pages back is close to sequential (measured here: 256 x 2.2 MiB chunks read at
1.9-2.0 GB/s flat against 1.5-1.6 GB/s spread over 256 subdirectories, raw 2.4 GB/s).
`seq` makes names unique per write, so deleting an old copy can never remove a newer one of
the same page.

Threading: every method here runs on the engine thread; the closures handed to the `IOPool`
touch only files and the buffers they were given. Results are applied by `finish_*` when the
engine reaps the future, so the budget and the stats change on one thread only.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from enum import IntEnum
from pathlib import Path

from backend.cache.chunk_format import (
    ChunkError,
    ChunkHeader,
    Expected,
    header_len,
    unpack_header,
)
from backend.cache.file_io import TMP_SUFFIX, DiskFullError, PosixChunkIO, probe_o_direct
from backend.cache.io_pool import IOPool, Priority
from backend.cache.page_io import PageLayout
from backend.cache.tier_stats import (
    BAD_HEADER,
    FOREIGN,
    LAYOUT,
    TORN,
    TierStats,
)

log = logging.getLogger(__name__)
SUFFIX = ".kv"


class ChunkState(IntEnum):
    WRITING = 0  # reserved in the budget, not readable
    READY = 1  # written and renamed: readable
    DELETING = 2  # unlink queued; bytes still counted


class SsdChunk:
    """One chunk file. `nbytes` counts against the budget from reservation to deletion."""

    __slots__ = ("path", "prefix_hash", "seq", "nbytes", "state")

    def __init__(self, path: str, prefix_hash: bytes, seq: int, nbytes: int) -> None:
        self.path, self.prefix_hash, self.seq, self.nbytes = path, prefix_hash, seq, nbytes
        self.state = ChunkState.WRITING

    def __repr__(self) -> str:
        return f"SsdChunk({os.path.basename(self.path)}, {self.state.name})"


class SsdStore:
    def __init__(
        self,
        directory: str | Path,
        budget_bytes: int,
        layout: PageLayout,
        fingerprint: bytes,
        pool: IOPool,
        stats: TierStats,
        chunk_io: PosixChunkIO | None = None,
        o_direct: bool = True,
    ) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file there, no permission, a read-only file system
            raise ValueError(f"the SSD tier's folder {self.dir} cannot be used: {exc}") from None
        self.budget_bytes = budget_bytes
        self.layout = layout
        self.layout_text = layout.describe()
        self.fingerprint = fingerprint
        self.pool, self.stats = pool, stats
        self.io = chunk_io or PosixChunkIO(o_direct and probe_o_direct(self.dir))
        self.header_len = header_len(layout)
        self.chunk_bytes = self.header_len + layout.kv_stride + layout.anchor_stride
        self.used_bytes = 0  # WRITING + READY + DELETING chunks: what the files may hold
        self.deleting_bytes = 0  # DELETING chunks: freed for the budget, unlink pending
        self.disk_full = False
        self._next_seq = 1
        self._warned: set[str] = set()

    # Budget -----------------------------------------------------------------------------
    def room_short(self) -> int:
        """Bytes that must be freed before one more chunk fits the budget (0 if it fits)."""
        live = self.used_bytes - self.deleting_bytes
        return max(0, live + self.chunk_bytes - self.budget_bytes)

    def can_write(self) -> bool:
        """Whether one more chunk may be written now; warns once and counts a refusal."""
        if self.disk_full:
            self._refuse("disk", "SSD tier: the disk is full; SSD writes stop, serving goes on")
            return False
        if self.room_short():
            self._refuse("budget", f"SSD tier: byte budget {self.budget_bytes} is exhausted; "
                         "SSD writes stop until pages are freed, serving goes on")  # fmt: skip
            return False
        return True

    def _refuse(self, kind: str, message: str) -> None:
        self.stats.writes_skipped_full += 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

    # Writes -----------------------------------------------------------------------------
    def submit_write(self, header: ChunkHeader, payload, padded, ready=None, priority=None):
        """Queues a write of one page; returns (chunk, future). payload: the unpadded KV and
        anchor buffers (checksummed); padded: the aligned sections written to the file;
        ready: blocks until those host buffers hold the data (CUDA copies), or None."""
        seq = self._next_seq
        self._next_seq += 1
        chunk = SsdChunk(self._path(header.prefix_hash, seq), header.prefix_hash, seq,
                         self.chunk_bytes)  # fmt: skip
        self.used_bytes += chunk.nbytes
        hlen = self.header_len

        def write() -> int:
            if ready is not None:
                ready()
            return self.io.write_chunk(chunk.path, header._replace(header_len=hlen), payload,
                                       padded)

        future = self.pool.submit(priority or Priority.WRITEBACK, write)
        return chunk, future

    def finish_write(self, chunk: SsdChunk, future: Future) -> bool:
        """Applies a completed write; True if the chunk is now readable."""
        error = future.exception()
        if error is None:
            chunk.state = ChunkState.READY
            self.stats.ssd_writes += 1
            self.stats.ssd_bytes_written += chunk.nbytes
            return True
        self.used_bytes -= chunk.nbytes
        if isinstance(error, DiskFullError):
            self.stats.disk_full_events += 1
            self.disk_full = True
            self._refuse("disk", f"SSD tier: {error}; SSD writes stop, serving goes on")
        else:
            self.stats.writes_failed += 1
            log.warning("SSD tier: writing %s failed: %r", chunk.path, error)
        return False

    # Reads ------------------------------------------------------------------------------
    def submit_read(self, chunk: SsdChunk, want: Expected, payload, padded, priority):
        """Queues a verified read into host buffers; the future's result is the seconds the
        read took, or it raises ChunkError (a miss: the buffers must not be served)."""
        if chunk.state != ChunkState.READY:
            raise ValueError(f"{chunk!r} is not readable")
        hlen = self.header_len

        def read() -> float:
            start = time.perf_counter()
            self.io.read_chunk(chunk.path, want, hlen, payload, padded)
            return time.perf_counter() - start

        return self.pool.submit(priority, read)

    def finish_read(self, chunk: SsdChunk, future: Future) -> bool:
        """Applies a completed read; True if the buffers hold the verified page."""
        error = future.exception()
        if error is None:
            self.stats.ssd_reads += 1
            self.stats.ssd_bytes_read += chunk.nbytes
            self.stats.ssd_read_seconds += future.result()
            return True
        if not isinstance(error, ChunkError):
            raise error
        self.stats.chunk_rejects[error.reason] += 1
        log.warning("SSD tier: refused %s (%s); treated as a miss", chunk.path, error)
        return False

    # Deletes ----------------------------------------------------------------------------
    def submit_delete(self, chunk: SsdChunk) -> Future:
        if chunk.state != ChunkState.READY:
            raise ValueError(f"only a written chunk can be deleted, got {chunk!r}")
        chunk.state = ChunkState.DELETING
        self.deleting_bytes += chunk.nbytes

        def delete() -> None:
            try:
                self.io.delete(chunk.path)
            except FileNotFoundError:
                pass  # already gone (e.g. removed by hand): the bytes are free either way

        return self.pool.submit(Priority.DELETE, delete)

    def finish_delete(self, chunk: SsdChunk, future: Future) -> None:
        self.used_bytes -= chunk.nbytes
        self.deleting_bytes -= chunk.nbytes
        self.stats.ssd_deletes += 1
        self.disk_full = False  # space came back: writes may resume
        error = future.exception()
        if error is not None:
            log.warning("SSD tier: deleting %s failed: %r", chunk.path, error)

    # Start-up ---------------------------------------------------------------------------
    def scan(self) -> list[tuple[SsdChunk, ChunkHeader]]:
        """Rebuilds the index from the chunk headers in the directory: strays, torn and
        corrupt files are deleted and counted, foreign ones (other model or layout) are left
        alone and counted; the newest copy of a page wins. Returns READY chunks in budget."""
        found: dict[bytes, tuple[SsdChunk, ChunkHeader]] = {}
        paths = sorted(p for p in self.dir.iterdir() if p.is_file())
        jobs = [(p, self.pool.submit(Priority.FOREGROUND, self._head_job(p))) for p in paths]
        for path, future in jobs:
            item = self._admit_scanned(path, future)
            if item is None:
                continue
            chunk, h = item
            old = found.get(h.prefix_hash)
            if old is not None:
                loser = min(old, item, key=lambda c: c[0].seq)
                self._delete_now(loser[0].path)
                if loser is old:
                    found[h.prefix_hash] = item
            else:
                found[h.prefix_hash] = item
        kept: list[tuple[SsdChunk, ChunkHeader]] = []
        for item in sorted(found.values(), key=lambda c: c[0].seq, reverse=True):
            chunk = item[0]
            self._next_seq = max(self._next_seq, chunk.seq + 1)
            if self.used_bytes + chunk.nbytes > self.budget_bytes:
                self._delete_now(chunk.path)  # newest first: the oldest go beyond the budget
                continue
            self.used_bytes += chunk.nbytes
            kept.append(item)
        self.stats.restored_chunks += len(kept)
        return kept

    def _head_job(self, path: Path):
        return lambda: self.io.read_head(str(path), self.header_len)

    def _admit_scanned(self, path: Path, future: Future) -> tuple[SsdChunk, ChunkHeader] | None:
        name = path.name
        if name.endswith(TMP_SUFFIX):
            self.stats.stray_temp_files += 1
            self._delete_now(str(path))
            return None
        parts = name.split(".")
        if len(parts) != 3 or "." + parts[2] != SUFFIX:
            return None  # not ours
        try:
            data, size = future.result()
            h = unpack_header(data)
            if h.fingerprint != self.fingerprint:
                raise ChunkError(FOREIGN)
            lay = self.layout
            if (h.layout, h.kv_len, h.anchor_len) != (
                self.layout_text,
                lay.kv_bytes,
                lay.anchor_bytes,
            ):
                raise ChunkError(LAYOUT)
            if h.prefix_hash.hex() != parts[0]:
                raise ChunkError(BAD_HEADER, "name and header disagree")
            if h.header_len != self.header_len or size != h.file_len:
                raise ChunkError(TORN, f"{size} bytes, header says {h.file_len}")
            seq = int(parts[1], 16)
        except (ChunkError, ValueError, OSError) as e:
            reason = e.reason if isinstance(e, ChunkError) else BAD_HEADER
            self.stats.chunk_rejects[reason] += 1
            if reason not in (FOREIGN, LAYOUT):
                self._delete_now(str(path))
            return None
        chunk = SsdChunk(str(path), h.prefix_hash, seq, size)
        chunk.state = ChunkState.READY
        return chunk, h

    def _delete_now(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _path(self, prefix_hash: bytes, seq: int) -> str:
        return os.path.join(self.dir, f"{prefix_hash.hex()}.{seq:x}{SUFFIX}")
