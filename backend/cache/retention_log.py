"""Retention priorities that outlive a restart, beside the SSD tier's chunks.

A page's retention priority (`retention.py`) lives on its tree node, and a warm restart
rebuilds nodes from the SSD chunks' headers, which are written once, often before a request
gives the page its priority. So each priority a request sets on a page is also appended to
`retention.log` in the SSD directory, one line per change:

    <prefix hash, 32 hex digits> <priority> <expiry: wall-clock seconds, or "-": never>

A page keeps every grant still running that no other outdoes (a higher priority for
longer): a shorter raise of another request ends before a longer, lower priority does, which
then holds again (`Evictor.expire`); a line with the default priority for good forgets the
page's grants (it left every tier). At start-up the file is read (lines that do not parse,
and priorities already expired, are skipped: a cache may forget, never mistake one page for
another, since the prefix hash names the page and its whole prefix in its namespace) and
rewritten with what is left; when it grows to several times its live entries it is rewritten
again. A restored page takes its logged priority for the rest of its duration.

The log is best-effort, as the SSD tier's chunks are: where a write fails (a full disk, the
directory gone) it warns once, counts the failure (`write_errors`) and goes on; the priority
still holds in this process, and a restart may forget it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Container
from pathlib import Path

from backend.cache.retention import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, keep_grant

FILE_NAME = "retention.log"
COMPACT_MIN_LINES = 4096  # rewrite once the file holds this many lines and ...
COMPACT_FACTOR = 4  # ... this many times its live entries

log = logging.getLogger(__name__)


class RetentionLog:
    def __init__(self, directory: str | Path, on_disk: Container[bytes] | None = None,
                 clock=time.time) -> None:
        """`on_disk`: the prefix hashes of the chunks found at start-up (lines of other
        pages are dropped; None: all kept)."""
        self.path = Path(directory) / FILE_NAME
        self.clock = clock
        # prefix hash -> its grants: (priority, expiry in wall-clock seconds or None)
        self.entries: dict[bytes, list[tuple[int, float | None]]] = {}
        self.skipped = 0  # lines that did not parse (a torn last line, a foreign file)
        self.write_errors = 0  # appends and rewrites that failed (OSError)
        self._read()
        if on_disk is not None:
            self.entries = {k: v for k, v in self.entries.items() if k in on_disk}
        self._rewrite()

    def record(self, prefix_hash: bytes, priority: int, expires: float | None) -> None:
        """A page's priority as a request set it (`expires`: wall-clock seconds); the default
        for good forgets the page's line (a page that left every tier)."""
        if priority == DEFAULT_PRIORITY and expires is None:
            if self.entries.pop(prefix_hash, None) is None:
                return
        elif not self._add(prefix_hash, priority, expires, self.clock()):
            return  # outdone by a grant it holds: nothing to log
        try:
            with open(self.path, "a") as f:
                f.write(_line(prefix_hash, priority, expires))
        except OSError as error:
            self._failed("appending to", error)
            return
        self.lines += 1
        if self.lines >= COMPACT_MIN_LINES and self.lines >= COMPACT_FACTOR * self._num_grants():
            self._rewrite()

    def _add(self, key: bytes, priority: int, expires: float | None, now: float) -> bool:
        """Adds a grant to the page's, dropping the expired ones and those it outdoes;
        False where one it holds outdoes it."""
        grants = [(p, e) for p, e in self.entries.get(key, ()) if e is None or e > now]
        self.entries[key] = grants
        return keep_grant(grants, (priority, expires))

    def _num_grants(self) -> int:
        return sum(map(len, self.entries.values()))

    def grants(self, prefix_hash: bytes) -> list[tuple[int, float | None]]:
        """The page's grants still running: (priority, seconds left: None = never expires),
        strongest first."""
        now = self.clock()
        found = [(p, None if e is None else e - now) for p, e in self.entries.get(prefix_hash, ())
                 if e is None or e > now]
        return sorted(found, key=lambda g: (-g[0], g[1] is not None, -(g[1] or 0.0)))

    def lookup(self, prefix_hash: bytes) -> tuple[int, float | None] | None:
        """(priority, seconds left: None = never expires) of a page's strongest grant now,
        None where none is logged or every one expired."""
        found = self.grants(prefix_hash)
        return found[0] if found else None

    def _read(self) -> None:
        self.lines = 0
        try:
            text = self.path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return
        now = self.clock()
        for line in text.split("\n"):
            if not line:
                continue
            parsed = _parse(line)
            if parsed is None:
                self.skipped += 1
                continue
            key, priority, expires = parsed
            if priority == DEFAULT_PRIORITY and expires is None:
                self.entries.pop(key, None)
            elif expires is None or expires > now:
                self._add(key, priority, expires, now)

    def _rewrite(self) -> None:
        """The live entries only, written to a new file that replaces the old one whole."""
        now = self.clock()
        live = {k: kept for k, v in self.entries.items()
                if (kept := [(p, e) for p, e in v if e is None or e > now])}
        self.entries = live
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                f.writelines(_line(k, p, e) for k, v in live.items() for p, e in v)
            os.replace(tmp, self.path)
        except OSError as error:
            self._failed("rewriting", error)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return
        self.lines = self._num_grants()

    def _failed(self, doing: str, error: OSError) -> None:
        if not self.write_errors:
            log.warning("retention log: %s %s failed (%r); priorities set from now on may "
                        "not survive a restart, serving goes on", doing, self.path, error)
        self.write_errors += 1


def _line(prefix_hash: bytes, priority: int, expires: float | None) -> str:
    return f"{prefix_hash.hex()} {priority} {'-' if expires is None else repr(expires)}\n"


def _parse(line: str) -> tuple[bytes, int, float | None] | None:
    parts = line.split(" ")
    if len(parts) != 3 or len(parts[0]) != 32:
        return None
    try:
        key = bytes.fromhex(parts[0])
        priority = int(parts[1])
        expires = None if parts[2] == "-" else float(parts[2])
    except ValueError:
        return None
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY or \
            (expires is not None and not expires == expires):  # NaN
        return None
    return key, priority, expires
