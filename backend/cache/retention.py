"""KV cache retention priorities (TensorRT-LLM's `KvCacheRetentionConfig`).

A request may say how long the store should keep the pages it leaves behind: a priority in
[0, 100] (default 35) for ranges of its prompt tokens and one for the pages holding its
generated tokens, each optionally for a duration, after which it reverts to the default. A
system prompt shared by every call of an agent is the typical use (priority 100), a one-off
retrieved document the opposite (priority 0).

How the store uses them (`backend/cache/eviction.py`, `policy.py`, `tier_space.py`):
- A page's priority is set when a request that used it leaves the engine (finishes, is
  cancelled or preempted): the first such request's priority for that page, after which
  only raised by later ones (a higher priority, or the same one expiring later). So one
  request cannot lower what another asked for; a priority ends only by its duration, and
  then the strongest grant still running holds (a lower one that outlasts it: a shorter
  raise does not end a longer priority), else the default until the next request sets it
  again. A request without a retention config gives its pages the default, so a
  low-priority page that later requests reuse stops being first to go.
- A page's priority for a request: the highest of the ranges that overlap its tokens (with
  that range's duration; the longest one where several share it); pages holding generated
  tokens also take the decode priority; pages no range covers take the default.
- Device eviction: lowest priority first, least recently used within a priority; the
  look-ahead window's pages still go last. Checkpoints (checkpoint policy) follow their
  page's priority the same way.
- DRAM and SSD (pages and checkpoints): those above the default priority go only when no
  other can, like the look-ahead window's; below the default they are ordered as default
  ones there.
- Across a warm restart (SSD tier): every priority set is logged beside the chunks and a
  restored page takes it back for the rest of its duration (`retention_log.py`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35

# (priority, duration in seconds or None = never expires) for one page.
PagePriority = tuple[int, float | None]


def _check_priority(name: str, priority: int) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"{name} must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], "
                         f"got {priority!r}")


def finite_seconds(value) -> bool:
    """Whether `value` is a real number of seconds a float holds (not a bool: True is no
    duration; numpy scalars are numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past the float range
        return False


def _check_duration(name: str, duration: float | None) -> None:
    if duration is not None and not (finite_seconds(duration) and duration >= 0):
        raise ValueError(f"{name} must be >= 0 seconds (or None: never expires), "
                         f"got {duration!r}")


@dataclass(frozen=True)
class RetentionRange:
    """Prompt tokens [start, end) (end None: to the prompt's end) at `priority`."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"a retention range's start must be an integer >= 0, got "
                             f"{self.start!r}")
        if self.end is not None and (isinstance(self.end, bool) or not isinstance(self.end, int)
                                     or self.end <= self.start):
            raise ValueError(f"a retention range's end must be an integer > its start "
                             f"({self.start}) or None (the prompt's end), got {self.end!r}")
        _check_priority("a retention range's priority", self.priority)
        _check_duration("a retention range's duration", self.duration_s)


@dataclass(frozen=True)
class RetentionConfig:
    ranges: tuple[RetentionRange, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ranges, (tuple, list)) or \
                not all(isinstance(r, RetentionRange) for r in self.ranges):
            raise ValueError(f"a retention config's ranges must be a sequence of "
                             f"RetentionRange, got {self.ranges!r}")
        object.__setattr__(self, "ranges", tuple(self.ranges))
        _check_priority("the decode retention priority", self.decode_priority)
        _check_duration("the decode retention duration", self.decode_duration_s)

    def page_priorities(self, num_pages: int, page_size: int,
                        prompt_len: int) -> list[PagePriority]:
        """The priority this config gives each of a sequence's first `num_pages` pages."""
        out = []
        for i in range(num_pages):
            start, end = i * page_size, (i + 1) * page_size
            found: list[PagePriority] = []
            for r in self.ranges:
                r_end = prompt_len if r.end is None else min(r.end, prompt_len)
                if r.start < min(end, r_end) and start < r_end:
                    found.append((r.priority, r.duration_s))
            if end > prompt_len:
                found.append((self.decode_priority, self.decode_duration_s))
            out.append(strongest(found) if found else (DEFAULT_PRIORITY, None))
        return out


DEFAULT_RETENTION = RetentionConfig()


def strongest(found: Iterable[PagePriority]) -> PagePriority:
    """The highest priority; among equal ones the longest duration (None: forever)."""
    best: PagePriority | None = None
    for p in found:
        if best is None or p[0] > best[0] or (p[0] == best[0] and outlasts(p[1], best[1])):
            best = p
    assert best is not None
    return best


def outlasts(a: float | None, b: float | None) -> bool:
    """Whether an expiry (or duration) `a` is later than `b` (None: never)."""
    return b is not None and (a is None or a > b)


def keep_grant(grants: list[PagePriority], grant: PagePriority) -> bool:
    """Adds `grant` (priority, expiry) to a page's `grants` unless one of them is at least
    as strong for at least as long; drops those it outdoes (grants stay few: one per
    priority at the most). Whether it was added."""
    priority, until = grant
    if any(p >= priority and not outlasts(until, u) for p, u in grants):
        return False
    grants[:] = [(p, u) for p, u in grants if not (priority >= p and not outlasts(u, until))]
    grants.append(grant)
    return True
