"""A subscriber of a server's KV cache events (`kv_events_endpoint`; the layout is in
`backend/cache/events.py`): what a KV-aware router reads, and `python -m client kv-events`.

    sub = KvEventSubscriber("tcp://127.0.0.1:5557", replay="tcp://127.0.0.1:5558")
    for message in sub.follow():  # every message once, in order: Message(seq, ts, events, gap)
        ...
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgpack
import zmq

from backend.cache.events import decode_event

log = logging.getLogger(__name__)
END = -1  # the replay's last message


class Message(NamedTuple):
    seq: int  # from 0, one per engine step that changed the cache
    ts: float  # the server's time.time() when it was made
    # ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name],
    # ["BlockRemoved", hashes, medium], ["AllBlocksCleared"] (events.FIELDS' order)
    events: list[list[Any]]
    gap: bool = False  # `follow`: messages before this one were lost (what they said unknown)


class KvEventSubscriber:
    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "kv-events",
                 context: zmq.Context | None = None) -> None:
        self._own = context is None
        self.context = context or zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay

    def receive(self, timeout_s: float) -> Message | None:
        """The next live message, or None when none came within `timeout_s`."""
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        _, seq, payload = self.sub.recv_multipart()
        return _message(seq, payload)

    def replay(self, start: int = 0, timeout_s: float = 10.0) -> Iterator[Message]:
        """The server's kept messages from `start` on (older ones are gone), in order."""
        if self.replay_endpoint is None:
            raise ValueError("no replay endpoint given")
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                if not sock.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint} within "
                                       f"{timeout_s} s")
                _, seq, payload = sock.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == END:
                    return
                yield _message(seq, payload)
        finally:
            sock.close()

    def follow(self, start: int = 0, idle_s: float | None = None,
               stop: threading.Event | None = None) -> Iterator[Message]:
        """Every message from `start` on, in order, once: the kept ones from the replay first
        (with a replay endpoint), then live ones, a gap in the numbers filled from the
        replay. A server that restarted (lower numbers, later timestamps) is followed from
        its first message. Where messages are lost for good (no longer kept, or no replay
        endpoint) the next one comes with `gap` set: an index built from them should start
        over. Ends when nothing came for `idle_s` seconds, or once `stop` is set."""
        expected, last_ts = start, 0.0
        waited = 0.0

        def passed(message: Message) -> Message:
            nonlocal expected, last_ts
            if message.seq != expected:
                message = message._replace(gap=True)
            expected, last_ts = message.seq + 1, message.ts
            return message

        if self.replay_endpoint is not None:
            for message in self.replay(start):
                yield passed(message)
        while stop is None or not stop.is_set():
            message = self.receive(0.2)
            if message is None:
                waited += 0.2
                if idle_s is not None and waited >= idle_s:
                    return
                continue
            waited = 0.0
            if message.seq < expected:
                if message.ts <= last_ts:
                    continue  # passed on already (from the replay)
                expected = 0  # the server restarted: its messages from 0
            if message.seq > expected and self.replay_endpoint is not None:
                try:
                    missed = [m for m in self.replay(expected) if m.seq < message.seq]
                except TimeoutError:
                    missed = []
                for m in missed:
                    yield passed(m)
            yield passed(message)

    def close(self) -> None:
        self.sub.close()
        if self._own:
            self.context.term()


def _message(seq: bytes, payload: bytes) -> Message:
    """A message, its events as lists whichever encoding the server sends (maps, or arrays:
    `kv_events_encoding`); one that does not decode has no events and `gap` set (what it
    said is lost)."""
    number = int.from_bytes(seq, "big", signed=True)
    try:
        ts, events = msgpack.unpackb(payload)[:2]
        return Message(number, float(ts), [decode_event(e) for e in events])
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        log.warning("kv-events: message %d does not decode (%s)", number, exc)
        return Message(number, 0.0, [], gap=True)
