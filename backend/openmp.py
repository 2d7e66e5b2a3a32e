"""OpenMP worker threads of the threads that run torch CPU ops.

PyTorch's Linux wheels parallelise CPU ops with GNU OpenMP (libgomp), which gives every thread
that starts a parallel region its own pool of worker threads, kept until that thread exits.
When the process holds more OpenMP threads than it has cores, libgomp stops letting idle
workers spin between parallel regions, so every region wakes its workers through the kernel.
A serving process loads the model on one thread (Triton's stub: its main thread) and computes
on another (the engine thread): two pools. Measured on this project's 2-core host, with the
engine thread's team next to the loading thread's idle one: a 32K-element `exp` takes 70 us
instead of 5, a replay of 128 anchors 35 ms instead of 13, a 16K-token prefill 5.9 s instead
of 4.1 (`tests/engine/test_openmp.py` checks the threads, `client/bench` the times).

- `release_workers()`: ends the calling thread's pool (OpenMP 5.0 `omp_pause_resource_all`,
  soft pause, which libgomp applies to the calling thread's pool only); the thread's next
  parallel region starts a new one. `Engine.start` calls it on the thread that built the
  engine, the engine thread whenever it goes idle (its next step starts the pool again), so
  only a busy engine holds workers.
- `serial_thread()`: the calling thread runs torch's own parallel loops (copies, elementwise
  ops) on itself alone, with no pool; MKL calls keep MKL's thread count. For helper threads
  that must not take the engine's cores: the KV transfer threads.

Other OpenMP runtimes (LLVM's libomp, Intel's libiomp5) apply a pause to the whole process;
there both are no-ops, as they are where no OpenMP runtime is loaded.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None."""
    import torch  # noqa: F401  (loads torch's OpenMP runtime before the maps are read)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps}
    except OSError:
        return None
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libgomp")
                       and ".so" in p):  # fmt: skip
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all") and hasattr(lib, "omp_set_num_threads"):
            return lib
    return None


def release_workers() -> bool:
    """Ends the calling thread's OpenMP worker threads (outside any parallel region); True
    when libgomp accepted. The thread's next parallel torch op starts them again."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(ctypes.c_int(OMP_PAUSE_SOFT)) == 0


def serial_thread() -> None:
    """From now on the calling thread's torch CPU ops run on it alone (its OpenMP thread
    count is 1; other threads keep theirs)."""
    import torch

    lib = _libgomp()
    if lib is None:
        return
    torch.get_num_threads()  # torch sets a thread's OpenMP count at its first op: let it,
    lib.omp_set_num_threads(ctypes.c_int(1))  # then set this thread's to 1
