"""Layer-wise overlap of KV transfers with compute (PCR section 4.3).

`LayerwiseLoad`: the promoted pages' KV goes host -> device one attention layer at a time;
attention layer a calls `wait(a)` before it reads KV, so layer a+1's copy runs while layer a
computes and only about one layer's transfer stays exposed.
`LayerwiseOffload`: after attention layer a wrote the new pages' KV, `layer_done(a)` queues
its device -> host copy, which runs while the later layers compute; `finish()` after the
forward waits for the rest.

CPU: a `TransferThread` per direction runs the copies (torch copies release the GIL) and a
`threading.Event` per layer says it is done. CUDA: copies go on a side stream with one CUDA
event per layer, and `wait(a)` makes the compute stream wait on that event (nothing blocks
the host).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from backend import openmp
from backend.cache.host_pool import HostPool
from backend.cache.page_io import DeviceBuffers


class TransferThread:
    """One daemon thread running copy jobs in FIFO order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        # Copies run on this thread alone: an OpenMP pool here would take the engine's cores
        # and throttle its pool (backend/openmp.py).
        openmp.serial_thread()
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class _LayerSignals:
    """Per-layer jobs and completion: threading events on CPU, CUDA events on a GPU.

    A layer's copies run once, on whichever thread claims them first: the transfer thread
    in queue order, or the engine thread in `wait` when the transfer thread has not reached
    that layer yet (on a busy CPU, waking a thread costs about as much as a layer's copy,
    and the engine thread would only sit waiting)."""

    def __init__(self, num_layers: int, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream
        self.events = [threading.Event() for _ in range(num_layers)]
        self.cuda_events: list[torch.cuda.Event | None] = [None] * num_layers
        self.done_at = [0.0] * num_layers  # perf_counter when each layer finished (CPU)
        self.error: BaseException | None = None
        self._copies: list[Callable[[], None] | None] = [None] * num_layers
        self._claimed = [False] * num_layers
        self._lock = threading.Lock()

    def submit(self, layer: int, copies: Callable[[], None], worker) -> None:
        self._copies[layer] = copies
        if worker is None:
            self._run_if_unclaimed(layer)
        else:
            worker.submit(lambda: self._run_if_unclaimed(layer))

    def _run_if_unclaimed(self, layer: int) -> None:
        with self._lock:
            if self._claimed[layer]:
                return
            self._claimed[layer] = True
        self._run(layer, self._copies[layer])

    def _run(self, layer: int, copies: Callable[[], None]) -> None:
        try:
            if self.error is None:
                if self.stream is None:
                    copies()
                else:
                    with torch.cuda.stream(self.stream):
                        copies()
                        ev = torch.cuda.Event()
                        ev.record(self.stream)
                    self.cuda_events[layer] = ev
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() on the engine thread
            self.error = e
        finally:
            self.done_at[layer] = time.perf_counter()
            self.events[layer].set()

    def wait(self, layer: int) -> None:
        if self._copies[layer] is not None and not self.events[layer].is_set():
            self._run_if_unclaimed(layer)  # not started yet: do it here
        self.events[layer].wait()
        if self.error is not None:
            raise RuntimeError(f"layer-wise transfer failed at layer {layer}") from self.error
        ev = self.cuda_events[layer]
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)


class LayerwiseLoad:
    """Host -> device copy of promoted pages' KV, layer by layer.

    items: (host slot, device KV page) pairs. `start()` copies layer 0 (CPU: it is exposed
    either way) and queues the others; `wait(a)` returns once layer a of every page is on the
    device (on CUDA: all layers are queued on the side stream and `wait(a)` orders the
    compute stream after layer a's event).
    """

    def __init__(
        self,
        buffers: DeviceBuffers,
        host: HostPool,
        worker: TransferThread | None,
        items: Sequence[tuple[int, int]] = (),
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.buffers, self.host, self.worker = buffers, host, worker
        self.items = list(items)
        self.num_layers = buffers.layout.num_layers
        self.signals = _LayerSignals(self.num_layers, stream)
        self.started_at = 0.0

    def start(self) -> LayerwiseLoad:
        self.started_at = time.perf_counter()
        stream = self.signals.stream
        nb = stream is not None
        if nb:  # the pages may have been read by earlier kernels before they were reused
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        worker = self.worker if self.items else None
        for layer in range(self.num_layers):

            def copies(layer=layer) -> None:
                for slot, page in self.items:
                    self.buffers.copy_layer_in(layer, page, self.host.kv_view(slot), nb)

            # Layer 0 is needed first and nothing can overlap it: copy it here, before the
            # transfer thread starts competing for the same memory bandwidth.
            self.signals.submit(layer, copies, worker if layer else None)
        return self

    def wait(self, layer: int) -> None:
        """Blocks until attention layer `layer`'s KV of every promoted page is loaded."""
        self.signals.wait(layer)

    def wait_all(self) -> None:
        for layer in range(self.num_layers):
            self.signals.wait(layer)

    @property
    def done(self) -> bool:
        return all(e.is_set() for e in self.signals.events)


class LayerwiseOffload:
    """Device -> host copy of new pages' KV, each layer queued once the model wrote it.

    items: (device KV page, host slot) pairs; `layer_done(a)` after attention layer a wrote
    its KV; `finish()` queues any layer not signalled yet and waits for all.
    """

    def __init__(
        self,
        buffers: DeviceBuffers,
        host: HostPool,
        worker: TransferThread | None,
        items: Sequence[tuple[int, int]] = (),
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.buffers, self.host, self.worker = buffers, host, worker
        self.items = list(items)
        self.num_layers = buffers.layout.num_layers
        self.signals = _LayerSignals(self.num_layers, stream)
        self._queued = [False] * self.num_layers

    @property
    def slot_of_page(self) -> dict[int, int]:
        return {page: slot for page, slot in self.items}

    def layer_done(self, layer: int) -> None:
        """Attention layer `layer` has written the new KV: start copying it out."""
        if self._queued[layer]:
            return
        self._queued[layer] = True
        nb = self.signals.stream is not None
        if nb:  # the copy must follow the compute that wrote the KV
            self.signals.stream.wait_stream(torch.cuda.current_stream(self.signals.stream.device))

        def copies() -> None:
            for page, slot in self.items:
                self.buffers.copy_layer_out(layer, page, self.host.kv_view(slot), nb)

        self.signals.submit(layer, copies, self.worker if self.items else None)

    def finish(self) -> None:
        """Copies what is left (layers the transfer thread has not reached run here)."""
        for layer in range(self.num_layers):
            self.layer_done(layer)
        for layer in range(self.num_layers):
            self.signals.wait(layer)
        for ev in self.signals.cuda_events:
            if ev is not None:
                ev.synchronize()  # the host copies are read by SSD write-back threads

    @property
    def done(self) -> bool:
        return all(e.is_set() for e in self.signals.events)
