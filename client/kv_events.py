"""A subscriber of a server's KV cache events (`kv_events_endpoint`; the layout is in
`backend/cache/events.py`): what a KV-aware router reads, and `python -m client kv-events`.

    sub = KvEventSubscriber("tcp://127.0.0.1:5557", replay="tcp://127.0.0.1:5558")
    for message in sub.follow():  # every message once, in order: Message(seq, ts, events, gap)
        ...
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

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
        # The connection's drops and (re)connections: messages sent while there was none are
        # lost without a trace in the numbers until the next one comes (`follow` fills them
        # from the replay at once, or marks the next message a gap).
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED
                                                    | zmq.EVENT_CONNECTED)
        self._dropped = self._connected = False
        self._poller = zmq.Poller()
        self._poller.register(self.sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.replay_timeout_s = 10.0  # `follow`'s wait for a replay's next message
        self.replayed_from: bytes | None = None  # the last replay's server start (`replay`)

    def receive(self, timeout_s: float) -> Message | None:
        """The next live message, or None when none came within `timeout_s` (a message of
        other than three frames, [topic, 8-byte number, payload], is not one: skipped)."""
        deadline = time.monotonic() + timeout_s
        while ready := dict(self._poller.poll(max(0, int((deadline - time.monotonic())
                                                          * 1000)))):
            if self._monitor in ready:
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    self._connected = True
                else:
                    self._dropped = True
            if self.sub not in ready:
                continue
            frames = self.sub.recv_multipart()
            if len(frames) == 3 and len(frames[1]) == 8:
                return _message(frames[1], frames[2])
            log.warning("kv-events: a message of %d frames is not an event message: skipped",
                        len(frames))
        return None

    def replay(self, start: int = 0, timeout_s: float = 10.0) -> Iterator[Message]:
        """The server's kept messages from `start` on (older ones are gone), in order; once
        it ends, `replayed_from` is the answering server start's id (None: an older server's
        empty end marker). TimeoutError where the answer stops coming."""
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
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue  # (not the replay's layout)
                _, seq, payload = frames
                if int.from_bytes(seq, "big", signed=True) == END:
                    self.replayed_from = payload or None
                    return
                yield _message(seq, payload)
        finally:
            sock.close()

    def _replayed(self, start: int, before: int | None = None) -> tuple[list[Message], bool]:
        """The kept messages from `start` (those numbered below `before`) and whether the
        replay answered to its end: where it stopped (the server not up yet, or lost), what
        came is kept and the rest counts as lost."""
        out: list[Message] = []
        try:
            for m in self.replay(start, self.replay_timeout_s):
                if before is None or m.seq < before:
                    out.append(m)
        except TimeoutError as exc:
            log.warning("kv-events: %s (%d messages replayed)", exc, len(out))
            return out, False
        return out, True

    def follow(self, start: int = 0, idle_s: float | None = None,
               stop: threading.Event | None = None) -> Iterator[Message]:
        """Every message from `start` on, in order, once: the kept ones from the replay first
        (with a replay endpoint), then live ones; a gap in the numbers, and each new
        connection (what a server sent before it reached us: one that started after us, or
        came back), filled from the replay. A server that restarted (lower numbers and later
        timestamps, or a replay answered by another server start than the one before) is
        followed from its first kept message. Where messages are lost for good (no longer
        kept; no replay endpoint and a gap or a dropped connection; a replay that stopped
        answering) the next one comes with `gap` set: an index built from them should start
        over. A server that is not up yet is waited for. Ends when nothing came for `idle_s`
        seconds, or once `stop` is set."""
        expected, last_ts = start, 0.0
        waited = 0.0
        instance: bytes | None = None  # the server start the last replay came from

        def passed(message: Message) -> Message:
            nonlocal expected, last_ts
            if message.seq != expected:
                message = message._replace(gap=True)
            expected, last_ts = message.seq + 1, message.ts
            return message

        def fill(before: int | None) -> Iterator[Message]:
            """The kept messages from `expected` on (those before `before`)."""
            nonlocal expected, instance
            self.replayed_from = None
            missed, whole = self._replayed(expected, before)
            if whole and instance is not None and self.replayed_from is not None \
                    and self.replayed_from != instance:
                # another server start answered: ours restarted and its numbers caught up
                # with ours. Its kept messages from its first on, the index anew.
                expected = -1  # (the first one passed is a gap)
                missed, _ = self._replayed(0, before)
            if whole and self.replayed_from is not None:
                instance = self.replayed_from
            for m in missed:
                yield passed(m)

        if self.replay_endpoint is not None:
            yield from fill(None)
        while stop is None or not stop.is_set():
            message = self.receive(0.2)
            # (the connection dropped since the last message: any number of messages may be
            # lost, from this server start or another)
            dropped, self._dropped = self._dropped, False
            connected, self._connected = self._connected, False
            if connected and self.replay_endpoint is not None:
                yield from fill(message.seq if message is not None else None)
            if message is None:
                self._dropped |= dropped  # (for the next message)
                waited += 0.2
                if idle_s is not None and waited >= idle_s:
                    return
                continue
            waited = 0.0
            if message.seq < expected:
                if message.ts <= last_ts:
                    continue  # passed on already (from the replay)
                expected, instance = 0, None  # the server restarted: its messages from 0
            if dropped and self.replay_endpoint is None:
                message = message._replace(gap=True)
            if (message.seq > expected or dropped) and self.replay_endpoint is not None:
                yield from fill(message.seq)
            yield passed(message)

    def close(self) -> None:
        self.sub.disable_monitor()
        self._monitor.close()
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
