"""Chunk file I/O, run on the SSD I/O threads: one `pwritev` / `preadv` per chunk.

`PosixChunkIO` opens files with O_DIRECT where `probe_o_direct` says the filesystem accepts it
(buffers, offsets and lengths are all 4 KiB-aligned by construction); otherwise it uses
buffered I/O and drops the file's pages from the page cache after each transfer
(`posix_fadvise(DONTNEED)`), since the DRAM tier already holds what was read. Writes go to
`<name>.tmp` and are renamed into place, so a crash leaves a stray temp file, never a
half-written chunk under a live name.

`probe_kvikio()` finds KvikIO (GPUDirect Storage) only where CUDA and libcufile exist; the CPU
path never imports it.
"""

from __future__ import annotations

import ctypes.util
import errno
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from backend.cache.chunk_format import (
    ChunkError,
    ChunkHeader,
    Expected,
    check_header,
    pack_header,
    payload_checksum,
    unpack_header,
)
from backend.cache.host_pool import aligned_empty
from backend.cache.page_io import ALIGN
from backend.cache.tier_stats import CHECKSUM, IO_ERROR, MISSING, TORN

TMP_SUFFIX = ".tmp"
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DiskFullError(OSError):
    """ENOSPC / EDQUOT while writing a chunk."""


def probe_o_direct(directory: str | Path) -> bool:
    """True if an aligned O_DIRECT write and read round-trip works in `directory`."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}{TMP_SUFFIX}")
    buf = aligned_empty(ALIGN)
    buf.fill_(0x5A)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC | _O_DIRECT, 0o600)
        try:
            ok = os.pwrite(fd, memoryview(buf.numpy()), 0) == ALIGN
            back = aligned_empty(ALIGN)
            ok = ok and os.preadv(fd, [memoryview(back.numpy())], 0) == ALIGN
            return ok and bool((back == 0x5A).all())
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


class KvikioProbe(NamedTuple):
    available: bool
    reason: str


def probe_kvikio() -> KvikioProbe:
    """Whether the KvikIO backend can run here; never imports kvikio unless it can."""
    import torch

    if not torch.cuda.is_available():
        return KvikioProbe(False, "no CUDA device")
    if ctypes.util.find_library("cufile") is None:
        return KvikioProbe(False, "libcufile not found")
    if importlib.util.find_spec("kvikio") is None:
        return KvikioProbe(False, "kvikio is not installed")
    return KvikioProbe(True, "CUDA, libcufile and kvikio present")


class PosixChunkIO:
    """pread/pwrite of whole chunk files (O_DIRECT when `o_direct`)."""

    name = "posix"

    def __init__(self, o_direct: bool) -> None:
        self.o_direct = o_direct and bool(_O_DIRECT)
        self._flags = _O_DIRECT if self.o_direct else 0

    def write(self, path: str, buffers: Sequence[memoryview]) -> int:
        """Writes `buffers` back to back at offset 0 of `path` (via a temp file + rename)."""
        tmp = path + TMP_SUFFIX
        total = sum(len(b) for b in buffers)
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | self._flags, 0o600)
            try:
                _pwritev_all(fd, buffers)
                if not self.o_direct:
                    os.fdatasync(fd)  # DONTNEED only drops clean pages
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as e:
            _unlink_quietly(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(e.errno, f"no space for {path}") from e
            raise
        return total

    def read(self, path: str, buffers: Sequence[memoryview]) -> tuple[int, int]:
        """Fills `buffers` from offset 0 of `path`; returns (bytes read, file size)."""
        fd = os.open(path, os.O_RDONLY | self._flags)
        try:
            size = os.fstat(fd).st_size
            n = os.preadv(fd, list(buffers), 0)
            if not self.o_direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return n, size

    def write_chunk(self, path: str, header: ChunkHeader, payload: Sequence[memoryview],
                    sections: Sequence[memoryview]) -> int:
        """One chunk file: `header` with the checksum of `payload` (the unpadded buffers)
        filled in, then `sections` (the same bytes as stored, padded where the format pads)."""
        h = header._replace(payload_xxh3=payload_checksum(payload))
        head = aligned_empty(h.header_len)
        head.numpy()[:] = memoryview(pack_header(h))
        return self.write(path, [memoryview(head.numpy()), *sections])

    def read_chunk(self, path: str, want: Expected, header_len: int,
                   payload: Sequence[memoryview], sections: Sequence[memoryview],
                   file_len: int | None = None) -> ChunkHeader:
        """Reads one chunk file into `sections` and verifies it: the header against `want`,
        its length (`file_len`, else what the header says) and the checksum of `payload`.
        Raises ChunkError (a miss: the buffers must not be served)."""
        head = aligned_empty(header_len)
        try:
            n, size = self.read(path, [memoryview(head.numpy()), *sections])
        except FileNotFoundError as e:
            raise ChunkError(MISSING, path) from e
        except OSError as e:
            raise ChunkError(IO_ERROR, f"{path}: {e}") from e
        h = unpack_header(head.numpy())
        check_header(h, want)
        expected = h.file_len if file_len is None else file_len
        if h.header_len != header_len or size != expected or n != expected:
            raise ChunkError(TORN, f"{path}: {size} bytes, expected {expected}")
        if payload_checksum(payload) != h.payload_xxh3:
            raise ChunkError(CHECKSUM, path)
        return h

    def read_head(self, path: str, nbytes: int) -> tuple[bytes, int]:
        """The first `nbytes` (rounded up to 4 KiB) of `path`, and the file size."""
        buf = aligned_empty(-(-nbytes // ALIGN) * ALIGN)
        n, size = self.read(path, [memoryview(buf.numpy())])
        return bytes(buf[:n].numpy()), size

    @staticmethod
    def delete(path: str) -> None:
        os.unlink(path)


class KvikioChunkIO(PosixChunkIO):
    """Payload transfers through KvikIO (cuFile) where `probe_kvikio()` allows; the file
    protocol (temp name, rename, header) is unchanged. Not exercised on CPU-only machines."""

    name = "kvikio"

    def __init__(self) -> None:
        super().__init__(o_direct=False)
        import kvikio  # noqa: F401 - only reached after probe_kvikio() succeeded

        self._kvikio: Any = kvikio

    def write(self, path: str, buffers: Sequence[memoryview]) -> int:
        tmp = path + TMP_SUFFIX
        offset = 0
        try:
            with self._kvikio.CuFile(tmp, "w") as f:
                for buf in buffers:
                    offset += f.pwrite(buf, len(buf), offset).get()
            os.rename(tmp, path)
        except OSError as e:
            _unlink_quietly(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(e.errno, f"no space for {path}") from e
            raise
        return offset

    def read(self, path: str, buffers: Sequence[memoryview]) -> tuple[int, int]:
        size = os.stat(path).st_size
        offset = 0
        with self._kvikio.CuFile(path, "r") as f:
            futures = []
            for buf in buffers:
                futures.append(f.pread(buf, len(buf), offset))
                offset += len(buf)
            n = sum(fut.get() for fut in futures)
        return n, size


def make_chunk_io(o_direct: bool, use_kvikio: bool) -> PosixChunkIO:
    if use_kvikio and probe_kvikio().available:
        return KvikioChunkIO()
    return PosixChunkIO(o_direct)


def _pwritev_all(fd: int, buffers: Sequence[memoryview]) -> None:
    pending = [b.cast("B") for b in buffers]
    offset = 0
    while pending:
        n = os.pwritev(fd, pending, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if pending and n:
            pending[0] = pending[0][n:]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
