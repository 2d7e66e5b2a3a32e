"""One thread that turns queued outputs into Triton responses, in order.

The engine's output callback runs on the engine thread and must not block; building
`pb_utils` tensors and sending through a response sender is an IPC round trip to the server, so
the callback only enqueues and this thread sends. One FIFO keeps each request's responses in
the order the engine produced them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from backend.triton.responses import error_response


class GuardedSender:
    """A request's response sender that is never asked `is_cancelled()` once its final
    response is on its way. Triton frees the response factory behind a sender when the final
    response is sent, and asking it then crashes tritonserver (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled); the cancellation watcher asks from its own
    thread while the responder sends."""

    def __init__(self, sender: Any, final_flag: int) -> None:
        self._sender, self._final_flag = sender, final_flag
        self._lock = threading.Lock()
        self._final_sent = False

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._final_sent and bool(self._sender.is_cancelled())

    def send(self, response: Any = None, flags: int = 0) -> None:
        if flags & self._final_flag:
            with self._lock:
                self._final_sent = True
        if response is None:
            self._sender.send(flags=flags)
        else:
            self._sender.send(response, flags=flags)


@dataclass(frozen=True)
class Outgoing:
    sender: Any  # pb_utils.InferenceResponseSender (a GuardedSender for engine requests)
    tensors: dict[str, np.ndarray] | None = None  # None with no error: only the flag
    error: str | None = None
    error_code: str = "INTERNAL"
    final: bool = False


class Responder:
    def __init__(self, pb_utils: ModuleType) -> None:
        self.pb_utils = pb_utils
        self._queue: queue.SimpleQueue[Outgoing | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="hybrid_llm-responder", daemon=True)
        self._thread.start()

    def put(self, item: Outgoing) -> None:
        self._queue.put(item)

    def close(self, timeout: float = 10.0) -> None:
        """Sends what is queued, then stops the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def send_now(self, item: Outgoing) -> None:
        """Sends on the calling thread (for requests the engine never saw)."""
        send(self.pb_utils, item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.send_now(item)
            except Exception as exc:  # a client that went away must not stop the others
                log(self.pb_utils, f"hybrid_llm: sending a response failed: {exc!r}", "warn")


def send(pb: ModuleType, item: Outgoing) -> None:
    """One response (tensors or an error; the final flag alone) through its sender."""
    flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if item.final else 0
    if item.error is not None:
        response = error_response(pb, item.error, item.error_code)
    elif item.tensors is not None:
        tensors = [pb.Tensor(name, value) for name, value in item.tensors.items()]
        response = pb.InferenceResponse(output_tensors=tensors)
    else:
        item.sender.send(flags=flags)
        return
    item.sender.send(response, flags=flags)


def log(pb_utils: ModuleType, message: str, level: str = "info") -> None:
    logger = getattr(pb_utils, "Logger", None)
    if logger is None:
        print(message, flush=True)
        return
    getattr(logger, f"log_{level}", logger.log_info)(message)
