"""Layer-wise overlap: `wait(a)` returns once layer a is loaded (later layers may still be in
flight), loaded and offloaded bytes are exact, every layer is offloaded even if the model
skipped a signal, and a failed copy surfaces at `wait`."""

from __future__ import annotations

import pytest
import torch
from tier_helpers import LAYERS, make_buffers

from backend.cache.host_pool import HostPool
from backend.cache.overlap import LayerwiseLoad, LayerwiseOffload, TransferThread


class SteppedWorker:
    """Holds copy jobs until the test runs them, one layer at a time."""

    def __init__(self) -> None:
        self.jobs = []

    def submit(self, job) -> None:
        self.jobs.append(job)

    def run_one(self) -> None:
        self.jobs.pop(0)()


def _host_with_pages(buffers, num_slots):
    host = HostPool(buffers.layout, num_slots, pin=False)
    for slot in range(num_slots):
        host.kv_view(slot).copy_(torch.randn(buffers.layout.kv_shape))
    return host


def _device_page(buffers, page):
    rows = slice(page * 4, (page + 1) * 4)
    return torch.stack([torch.stack([buffers.k[a][rows], buffers.v[a][rows]])
                        for a in range(LAYERS)])  # fmt: skip


def test_wait_returns_per_layer_while_later_layers_are_in_flight():
    buffers = make_buffers(4)
    host = _host_with_pages(buffers, 2)
    worker = SteppedWorker()
    load = LayerwiseLoad(buffers, host, worker, [(0, 3), (1, 1)]).start()
    # start() copied layer 0 itself (nothing can overlap it); layers 1.. are queued.
    assert len(worker.jobs) == LAYERS - 1 and not load.done
    load.wait(0)
    assert torch.equal(_device_page(buffers, 3)[0], host.kv_view(0)[0])
    assert not torch.equal(_device_page(buffers, 3)[1], host.kv_view(0)[1])
    worker.run_one()
    load.wait(1)  # layer 1 is there; layers 2.. are not
    assert torch.equal(_device_page(buffers, 3)[1], host.kv_view(0)[1])
    assert not load.signals.events[2].is_set()
    while worker.jobs:
        worker.run_one()
    load.wait_all()
    assert torch.equal(_device_page(buffers, 3), host.kv_view(0))
    assert torch.equal(_device_page(buffers, 1), host.kv_view(1))


def test_load_on_a_transfer_thread_is_exact():
    buffers = make_buffers(8)
    host = _host_with_pages(buffers, 4)
    worker = TransferThread("test-load")
    items = [(slot, 7 - slot) for slot in range(4)]
    load = LayerwiseLoad(buffers, host, worker, items).start()
    for layer in range(LAYERS):
        load.wait(layer)
    for slot, page in items:
        assert torch.equal(_device_page(buffers, page), host.kv_view(slot))
    worker.close()


def test_offload_copies_each_layer_once_signalled_and_finishes_the_rest():
    buffers = make_buffers(4)
    for t in (*buffers.k, *buffers.v):
        t.copy_(torch.randn_like(t))
    host = HostPool(buffers.layout, 2, pin=False)
    worker = SteppedWorker()
    offload = LayerwiseOffload(buffers, host, worker, [(2, 0), (0, 1)])
    offload.layer_done(0)
    offload.layer_done(0)  # a second signal is ignored
    assert len(worker.jobs) == 1
    worker.run_one()
    assert torch.equal(host.kv_view(0)[0], _device_page(buffers, 2)[0])
    offload.worker = None  # run what finish() queues inline
    offload.finish()  # layers the model never signalled are copied too
    assert torch.equal(host.kv_view(0), _device_page(buffers, 2))
    assert torch.equal(host.kv_view(1), _device_page(buffers, 0))
    assert offload.slot_of_page == {2: 0, 0: 1}


def test_wait_runs_a_layer_the_transfer_thread_has_not_reached():
    buffers = make_buffers(4)
    host = _host_with_pages(buffers, 1)
    worker = SteppedWorker()
    load = LayerwiseLoad(buffers, host, worker, [(0, 2)]).start()
    load.wait(1)  # the transfer thread is busy elsewhere: the engine thread copies layer 1
    assert torch.equal(_device_page(buffers, 2)[1], host.kv_view(0)[1])
    assert not load.signals.events[2].is_set()
    buffers.k[1].zero_()
    while worker.jobs:
        worker.run_one()  # its job for layer 1 finds the layer done and does nothing
    assert not torch.equal(_device_page(buffers, 2)[1], host.kv_view(0)[1])
    load.wait_all()


def test_a_failed_copy_surfaces_at_wait():
    buffers = make_buffers(2)
    host = _host_with_pages(buffers, 1)
    load = LayerwiseLoad(buffers, host, None, [(0, 5)])  # page 5 does not exist
    load.start()
    with pytest.raises(RuntimeError, match="layer 0"):
        load.wait(0)


def test_an_empty_load_is_ready_at_once():
    buffers = make_buffers(2)
    load = LayerwiseLoad(buffers, HostPool(buffers.layout, 0, pin=False), None).start()
    assert load.done
    load.wait(LAYERS - 1)
