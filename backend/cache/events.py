"""KV cache events, for routers that send each request to the replica holding its prefix.

A router in front of several servers (Dynamo's KV router, llm-d's precise prefix-cache
scorer, SGLang's router) keeps an index of which pages each replica has; the replicas tell it
as pages come and go. This is vLLM's and SGLang's publishing layout, on ZeroMQ:

- a PUB socket (`kv_events_endpoint`, e.g. `tcp://*:5557`) sends one multipart message per
  engine step that changed the cache: [topic, sequence number (8 bytes, big-endian, from 0),
  payload]; the payload is msgpack `[timestamp, [event, ...]]`, each event a map whose
  "type" names it (vLLM's encoding since its PR 42892, 2026-06, and SGLang's; Dynamo's and
  llm-d's decoders read it):
  - `{"type": "BlockStored", "block_hashes": [hash, ...], "parent_block_hash": hash or None,
    "token_ids": [id, ...], "block_size": page size, "lora_id": None, "medium": ...,
    "lora_name": None}`: pages that joined the prefix tree, in order along one path (each
    page's parent is the one before it; the first page's is `parent_block_hash`, None for a
    prompt's first page); token ids are the pages' tokens, page size of them each; medium is
    where the KV was when the page joined, in vLLM's names: "GPU" (the device tier), "CPU"
    (DRAM) or "STORAGE" (SSD: a page restored at a warm restart). A page that moves between
    tiers later (demoted, promoted) is not announced again: it stays cached, on whichever
    tier, until a BlockRemoved (a hit on any tier is a hit; announcing the move as vLLM's
    offloading does, a removal from one medium and a store in another, would make routers
    that do not track media drop the page);
  - `{"type": "BlockRemoved", "block_hashes": [hash, ...], "medium": None}`: pages that left
    the tree (every tier);
  - `{"type": "AllBlocksCleared"}`: the first message of a starting server (forget what it
    had).
  `kv_events_encoding: array` sends the same fields as positional arrays instead, the layout
  of vLLM before that change (`["BlockStored", hashes, parent, token_ids, block_size, None,
  medium]`, `["BlockRemoved", hashes, None]`, `["AllBlocksCleared"]`), for older consumers.
- a ROUTER socket (`kv_events_replay_endpoint`, optional) resends missed messages: a DEALER
  sends [b"", start sequence number (8 bytes, big-endian)]; the reply is one [b"", sequence
  number, payload] per kept message from that one on (the last `kv_events_buffer_steps`),
  then [b"", -1 (8 bytes, signed), instance] (instance: 8 random bytes of this server start,
  so a subscriber that fills a gap from a restarted server knows it; consumers that read the
  payload of the end marker as empty ignore it).

A page's hash is 63 bits of BLAKE2b over its parent's hash (for a first page: the request's
`cache_salt`) and its token ids, so equal prefixes under one salt have equal hashes in every
replica, and a salt's pages never match another's. Under suffix replay (the default policy)
every cached page is a place a request can resume from (its anchors rebuild the recurrent
states); under the checkpoint policy a hit stops at the deepest page with a saved state, so a
router that counts pages overestimates it. The events describe this replica's prefix tree
only; a request's own pages while it runs are not in it until they are inserted.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
from collections import deque
from typing import Any

from backend.cache.base import Tier
from backend.cache.radix import TOKEN_BYTES, PageNode, lora_of

log = logging.getLogger(__name__)

MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.SSD: "STORAGE"}  # vLLM's medium names
ENCODINGS = ("map", "array")
# Each event's fields in order (the array encoding's positions, the map encoding's keys).
FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                          "lora_id", "medium", "lora_name"),
          "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
END = (-1).to_bytes(8, "big", signed=True)


def page_hash(parent: int | None, salt: str, key: bytes) -> int:
    """A page's hash: its parent's (a first page: its salt's) and its encoded tokens."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"p" + parent.to_bytes(8, "big") if parent is not None else b"s" + salt.encode())
    h.update(key)
    return int.from_bytes(h.digest(), "big") >> 1  # 63 bits: an int64 for every consumer


class KvEventLog:
    """The prefix tree's page additions and removals since the last `take` (the tree calls
    `stored` and `removed`; any thread may)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hashes: dict[PageNode, int] = {}
        self._pending: list[tuple] = []

    def stored(self, node: PageNode) -> None:
        with self._lock:
            parent = self._hashes.get(node.parent) if node.parent is not None else None
            h = page_hash(parent, node.salt, node.key)
            self._hashes[node] = h
            self._pending.append(("stored", node, h, parent))

    def removed(self, node: PageNode) -> None:
        with self._lock:
            h = self._hashes.pop(node, None)
            if h is not None:
                self._pending.append(("removed", h))

    def hash_of(self, node: PageNode) -> int | None:
        with self._lock:
            return self._hashes.get(node)

    def take(self) -> list[list[Any]]:
        """The events since the last call, runs of pages along one path (or of removals)
        merged into one event each."""
        with self._lock:
            pending, self._pending = self._pending, []
        events: list[list[Any]] = []
        for item in pending:
            last = events[-1] if events else None
            if item[0] == "removed":
                if last is not None and last[0] == "BlockRemoved":
                    last[1].append(item[1])
                else:
                    events.append(["BlockRemoved", [item[1]], None])
                continue
            _, node, h, parent = item
            medium = _medium(node)
            if last is not None and last[0] == "BlockStored" and last[1][-1] == parent \
                    and last[6] == medium:
                last[1].append(h)
                last[3].extend(node.tokens)
            else:
                event = ["BlockStored", [h], parent, list(node.tokens),
                         len(node.key) // TOKEN_BYTES, None, medium]
                lora = lora_of(node.salt)
                if lora is not None:  # a LoRA adapter's page: vLLM's lora_name field
                    event.append(lora)
                events.append(event)
        return events


def _medium(node: PageNode) -> str:
    """Where the page's KV is: the device unless only a lower tier holds it."""
    if node.kv_page is not None or node.kv_location is None:
        return MEDIUM[Tier.DEVICE]
    return MEDIUM[node.kv_location]


def encode_event(event: list[Any], encoding: str) -> list[Any] | dict[str, Any]:
    """An event as `KvEventLog.take` gives it (["BlockStored", ...]) in `encoding`."""
    if encoding == "array":
        return event
    fields = FIELDS[event[0]]
    values = list(event[1:]) + [None] * (len(fields) - len(event) + 1)
    return {"type": event[0], **dict(zip(fields, values))}


def decode_event(event: Any) -> list[Any]:
    """An event in either encoding as a list: its name, then its fields in FIELDS' order
    (absent ones None); fields a newer publisher adds are ignored. ValueError where it is
    neither, or where a field a router reads has the wrong type (hashes and token ids lists
    of integers, a page size >= 1): an index must not half-apply it."""
    if isinstance(event, dict):
        kind = event.get("type")
        if not isinstance(kind, str) or kind not in FIELDS:
            raise ValueError(f"unknown KV event {kind!r:.80}")
        out = [kind, *(event.get(f) for f in FIELDS[kind])]
    elif isinstance(event, (list, tuple)) and event and isinstance(event[0], str) \
            and event[0] in FIELDS:
        n = len(FIELDS[event[0]])
        out = [event[0], *event[1:n + 1], *[None] * (n + 1 - len(event))]
    else:
        raise ValueError(f"not a KV event: {event!r:.80}")
    fields = dict(zip(FIELDS[out[0]], out[1:]))
    for name in ("block_hashes", "token_ids"):
        if name in fields and not _integers(fields[name]):
            raise ValueError(f"{out[0]}: {name} must be a list of integers, got "
                             f"{fields[name]!r:.80}")
    parent = fields.get("parent_block_hash")
    if parent is not None and not _integers([parent]):
        raise ValueError(f"{out[0]}: parent_block_hash must be an integer or None")
    size = fields.get("block_size", 1)
    if not _integers([size]) or size < 1:
        raise ValueError(f"{out[0]}: block_size must be an integer >= 1, got {size!r:.80}")
    return out


def _integers(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in values)


class KvEventPublisher:
    """Sends a `KvEventLog`'s events over ZeroMQ from its own thread (see the module)."""

    def __init__(self, events: KvEventLog, endpoint: str, replay_endpoint: str = "",
                 topic: str = "kv-events", buffer_steps: int = 10_000,
                 encoding: str = "map") -> None:
        import msgpack
        import zmq

        if encoding not in ENCODINGS:
            raise ValueError(f"kv_events_encoding must be one of {', '.join(ENCODINGS)}, got "
                             f"{encoding!r}")
        self.events = events
        self.encoding = encoding
        self.topic = topic.encode()
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._context = zmq.Context()
        self._pub = self._bind(zmq.PUB, "kv_events_endpoint", endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._bind(zmq.ROUTER, "kv_events_replay_endpoint", replay_endpoint)
        # This publisher's start, in every replay's end marker: a subscriber that filled a gap
        # from another start than before knows the server restarted (its numbers caught up).
        self.instance = secrets.token_bytes(8)
        self._zmq = zmq
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._seq = 0  # the next message's number (= messages sent)
        self._flush_lock = threading.Lock()
        self._queue.put(self._batch([["AllBlocksCleared"]]))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def num_sent(self) -> int:
        return self._seq

    def _bind(self, kind: int, name: str, endpoint: str) -> Any:
        import zmq

        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:  # a replay of every kept message at once: a ROUTER drops
            sock.setsockopt(zmq.SNDHWM, 0)  # what passes its send limit (1000) silently
        try:
            _check_port(name, endpoint)
            sock.bind(endpoint)
        except ValueError:
            self._context.destroy(linger=0)
            raise
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ValueError(f"{name} {endpoint!r} cannot be bound: {exc}") from None
        return sock

    def flush(self) -> None:
        """Queues the events since the last flush as one message (none: nothing). The engine
        calls it after each step; the sending thread every 50 ms (changes made by other
        threads, e.g. a tier dropping pages, while the engine is idle)."""
        with self._flush_lock:  # taken and queued in one go: messages keep the events' order
            events = self.events.take()
            if events:
                self._queue.put(self._batch(events))

    def _batch(self, events: list[list[Any]]) -> bytes:
        return self._pack([time.time(), [encode_event(e, self.encoding) for e in events]])

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                self.flush()
                payload = b""
            if payload is None:
                return
            try:
                if payload:
                    seq = self._seq.to_bytes(8, "big", signed=True)
                    self._pub.send_multipart([self.topic, seq, payload])
                    self._kept.append((self._seq, payload))
                    self._seq += 1
                if self._replay is not None and poller.poll(0):
                    self._answer_replay()
            except zmq.ZMQError:
                log.exception("kv-events: sending failed")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        peer, start = frames[0], frames[-1]
        first = int.from_bytes(start, "big", signed=True) if len(start) == 8 else 0
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart([peer, b"", seq.to_bytes(8, "big", signed=True),
                                             payload])
        self._replay.send_multipart([peer, b"", END, self.instance])


def _check_port(name: str, endpoint: str) -> None:
    """A tcp endpoint's port is * or 0..65535 (ZeroMQ took tcp://*:99999 as port 34463)."""
    if not endpoint.startswith("tcp://"):
        return
    port = endpoint.rpartition(":")[2]
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ValueError(f"{name} {endpoint!r}: the port must be * or 0..65535, got {port!r}")
