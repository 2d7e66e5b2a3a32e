"""KV-aware routing over several Triton replicas of one model (`--triton-url` more than once).

Each replica's prefix cache announces its pages (`kv_events_endpoint`, `--kv-events` here in the
same order; `backend/cache/events.py`); `Router` keeps one index of page hashes per replica from
those events (a thread reads them) and sends each prompt to the replica that holds its longest
cached prefix: the prompt's page hashes are computed as the server computes them (its `cache_salt`,
page by page, up to its last token), so the count is the `cached_tokens` that replica will report (a
request for prompt log probabilities computes its whole prompt: the router, which does not see that,
counts its pages the same). Ties (no replica holds any of it, or several hold as much) go to the
replica with the fewest requests in flight, then in turn. A replica without events gets the ties
only.

The index is a hint: a page may leave a replica between the choice and the request's arrival (the
request then computes it), and nothing is ever served from it. A replica that restarts says
AllBlocksCleared (its index empties); without a replay endpoint that first message goes out as the
server starts, often before this frontend's subscription has reconnected, and is lost: the index
then keeps the old pages until the replica's next message shows the restart (its numbers start
again), so the first requests after a restart may go there for nothing. With a replay endpoint
(`--kv-events PUB,REPLAY`) the index starts from the messages the replica still keeps, and a lost
message (a gap in the sequence numbers) is read again from it; without one, pages announced before
the frontend came are not known, and a gap empties the index until the replica announces pages
again.

A replica that cannot be reached (the request failed before its first response: gRPC UNAVAILABLE) is
marked down for `down_s` seconds and the request goes to the next best one; a down replica gets
requests again after that, or sooner when no other is up. A replica whose request queue is full
(`max_queue_size`) hands the request to the next best one too, without being marked down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from backend.cache.events import page_hash
from backend.cache.radix import encode_tokens

log = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 64
DEFAULT_DOWN_S = 5.0


def check_router_settings(max_imbalance: int, down_s: float) -> None:
    """ValueError naming the setting (as its option) that is out of range."""
    if isinstance(max_imbalance, bool) or not isinstance(max_imbalance, int) or \
            max_imbalance < 0:
        raise ValueError(f"router-max-imbalance must be a whole number >= 0, got "
                         f"{max_imbalance!r}")
    if not (isinstance(down_s, (int, float)) and 0 <= down_s < float("inf")):
        raise ValueError(f"router-down-s must be a finite number of seconds >= 0, got "
                         f"{down_s!r}")


@dataclass
class ReplicaIndex:
    """One replica's announced pages and its requests in flight."""

    pages: set[int] = field(default_factory=set)
    page_size: int = DEFAULT_PAGE_SIZE
    inflight: int = 0
    routed: int = 0  # requests sent to it
    events: bool = False  # it publishes events
    following: bool = False  # a thread reads them now (`Router._follow`)
    down_until: float = 0.0  # time.monotonic() before which it gets no requests
    failures: int = 0  # requests that could not reach it

    def apply(self, message) -> None:
        """One event message (`client.kv_events.Message`, its events checked by
        `decode_event`)."""
        for event in message.events:
            if event[0] == "BlockStored":
                self.pages.update(event[1])
                self.page_size = event[4]
            elif event[0] == "BlockRemoved":
                self.pages.difference_update(event[1])
            elif event[0] == "AllBlocksCleared":
                self.pages.clear()


class Router:
    def __init__(self, num_replicas: int, events: Sequence[str | None] = (),
                 max_imbalance: int = 16, down_s: float = DEFAULT_DOWN_S) -> None:
        """`events`: per replica, "PUB" or "PUB,REPLAY" endpoints (None / missing: none).
        `max_imbalance`: a replica with this many more requests in flight than the least
        busy one gets no more until that evens out (a hot prefix does not pile every request
        on one replica), as SGLang's router's balance threshold. `down_s`: how long a
        replica that could not be reached is passed over."""
        check_router_settings(max_imbalance, down_s)
        self.replicas = [ReplicaIndex() for _ in range(num_replicas)]
        self.max_imbalance = max_imbalance
        self.down_s = down_s
        self._lock = threading.Lock()
        self._turn = 0
        self._stop = threading.Event()
        self._threads = []
        from client.kv_events import KvEventSubscriber

        subscribers = []
        try:
            for spec in events:
                pub, _, replay = (spec or "").partition(",")
                subscribers.append(KvEventSubscriber(pub, replay or None) if pub else None)
        except Exception as exc:  # zmq.ZMQError: a malformed endpoint
            for sub in subscribers:
                if sub is not None:
                    sub.close()
            raise ValueError(f"--kv-events {spec!r}: {exc}") from None
        for i, sub in enumerate(subscribers):
            if sub is not None:
                self.replicas[i].events = True
                thread = threading.Thread(target=self._follow, args=(i, sub),
                                          name=f"kv-events-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def cached_tokens(self, replica: int, ids: Sequence[int], salt: str = "") -> int:
        """The prefix of `ids` that `replica` announced, in tokens."""
        size = self.replicas[replica].page_size
        return self._cached(replica, self._hashes(ids, salt, size), size)

    @staticmethod
    def _hashes(ids: Sequence[int], salt: str, size: int) -> list[int]:
        """The page hashes of `ids`' whole pages, as the server computes them."""
        out, parent = [], None
        for start in range(0, len(ids) - size + 1, size):
            parent = page_hash(parent, salt, encode_tokens(list(ids[start:start + size])))
            out.append(parent)
        return out

    def _cached(self, replica: int, hashes: list[int], size: int) -> int:
        pages = self.replicas[replica].pages
        with self._lock:
            n = 0
            while n < len(hashes) and hashes[n] in pages:
                n += 1
        return n * size

    def pick(self, ids: Sequence[int], salt: str = "", exclude: Sequence[int] = ()) -> int:
        """The replica for a prompt of `ids` (counted in flight until `done`), none of
        `exclude` (those a retry already tried), an up one where any is."""
        if len(exclude) >= len(self.replicas):
            raise ValueError("every replica is excluded")
        chains: dict[int, list[int]] = {}  # page size -> hashes (one size for one model)
        scores = []
        for i, r in enumerate(self.replicas):
            if r.events and r.pages:
                hashes = chains.get(r.page_size)
                if hashes is None:  # (the server computes a prompt's last token always: a
                    # prompt that ends on a page boundary hits one page less than it has)
                    hashes = chains[r.page_size] = self._hashes(ids[:-1], salt, r.page_size)
                scores.append(self._cached(i, hashes, r.page_size))
            else:
                scores.append(0)
        now = time.monotonic()
        with self._lock:
            allowed = [i for i in range(len(self.replicas)) if i not in exclude]
            up = [i for i in allowed if self.replicas[i].down_until <= now]
            allowed = up or allowed
            least = min(self.replicas[i].inflight for i in allowed)
            open_ = [i for i in allowed
                     if self.replicas[i].inflight - least <= self.max_imbalance]
            best = max(scores[i] for i in open_)
            tied = [i for i in open_ if scores[i] == best]
            fewest = min(self.replicas[i].inflight for i in tied)
            tied = [i for i in tied if self.replicas[i].inflight == fewest]
            choice = tied[self._turn % len(tied)]
            self._turn += 1
            self.replicas[choice].inflight += 1
            self.replicas[choice].routed += 1
        return choice

    def failed(self, replica: int) -> None:
        """`replica` could not be reached: passed over for `down_s` seconds."""
        with self._lock:
            r = self.replicas[replica]
            r.down_until = time.monotonic() + self.down_s
            r.failures += 1
        log.warning("replica %d unreachable: passed over for %.1f s", replica, self.down_s)

    def stats(self) -> list[dict]:
        """Each replica's requests routed, in flight, announced pages, whether it has events
        (and whether they are being read now), whether it is up (not passed over after a
        failure) and its failures."""
        now = time.monotonic()
        with self._lock:
            return [{"routed": r.routed, "inflight": r.inflight, "pages": len(r.pages),
                     "events": r.events, "following": r.following,
                     "up": r.down_until <= now, "failures": r.failures}
                    for r in self.replicas]

    def done(self, replica: int) -> None:
        with self._lock:
            self.replicas[replica].inflight -= 1

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _follow(self, i: int, subscriber) -> None:
        """Applies replica `i`'s events as they come (its own thread owns `subscriber`); where
        some were lost, or one does not apply, the index starts over (it only forgets pages: a
        request routed elsewhere computes them, nothing is served wrong). Following fails only
        on something unforeseen: it starts again after a pause (1 s, doubling up to 30 s),
        the index empty meanwhile (`stats`: following false)."""
        index = self.replicas[i]
        pause = 1.0
        try:
            while not self._stop.is_set():
                try:
                    with self._lock:
                        index.following = True
                    for message in subscriber.follow(stop=self._stop):
                        with self._lock:
                            if message.gap:
                                index.pages.clear()
                            try:
                                index.apply(message)
                            except (TypeError, ValueError) as exc:  # (decode_event checks)
                                index.pages.clear()
                                log.warning("kv-events of replica %d: message %d does not "
                                            "apply (%s): its index starts over", i,
                                            message.seq, exc)
                        pause = 1.0
                except Exception:
                    log.exception("kv-events of replica %d stopped: following again in "
                                  "%.0f s", i, pause)
                with self._lock:
                    index.following = False
                    index.pages.clear()
                if self._stop.wait(pause):
                    return
                pause = min(30.0, pause * 2)
        finally:
            subscriber.close()
