"""OpenMP worker threads (backend/openmp.py): the engine thread's are the process's only ones.

Each case runs in a fresh interpreter, so the thread counts (every OS thread of the process,
from /proc/self/task) see no other test's threads. With two OpenMP pools on this machine's
cores every parallel region wakes its workers through the kernel (the engine's ops 1.5-3x
slower); these checks count the pools rather than time them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backend import openmp
from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(openmp._libgomp() is None,
                                reason="torch's OpenMP runtime here is not libgomp")

PRELUDE = """
import json, os, sys, threading, time
import torch
from backend import openmp
torch.set_num_threads(2)
big = torch.randn(1024, 1024)
def threads():
    return len(os.listdir("/proc/self/task"))
def settle(expected, timeout=5.0):  # threads end asynchronously
    end = time.monotonic() + timeout
    while threads() != expected and time.monotonic() < end:
        time.sleep(0.01)
    return threads()
"""


def run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_release_workers_ends_the_calling_threads_pool():
    out = run("""
        base = threads()
        big.exp()  # a parallel op: this thread's pool starts a worker
        with_pool = threads()
        released = openmp.release_workers()
        after = settle(base)
        big.exp()  # and the next op starts it again
        again = threads()
        print(json.dumps(dict(base=base, with_pool=with_pool, released=released, after=after,
                              again=again)))
    """)
    assert out["with_pool"] == out["base"] + 1
    assert out["released"] is True
    assert out["after"] == out["base"]
    assert out["again"] == out["base"] + 1


def test_serial_thread_runs_torch_ops_without_a_pool():
    out = run("""
        base = threads()
        counts = {}
        def helper(serial):
            if serial:
                openmp.serial_thread()
            dst = torch.empty_like(big)
            dst.copy_(big)
            dst.add_(big)
            counts[serial] = (threads(), torch.get_num_threads())
        for serial in (True, False):
            t = threading.Thread(target=helper, args=(serial,))
            t.start()
            t.join()
        print(json.dumps(dict(base=base, serial=counts[True], parallel=counts[False],
                              main=torch.get_num_threads())))
    """)
    assert out["serial"] == [out["base"] + 1, 1]  # the helper itself, no worker
    assert out["parallel"] == [out["base"] + 2, 2]  # the helper and its worker
    assert out["main"] == 2  # other threads keep their count


def test_an_idle_engine_and_its_builder_hold_no_workers(tmp_path):
    """The thread that loaded the model (a pool from loading) starts the engine: afterwards
    the process has one OpenMP pool at most, the busy engine thread's, and none when idle."""
    out = run(f"""
        from backend.engine import Engine, SamplingParams
        from backend.model import load_model
        base = threads()
        model = load_model({str(MODEL_REPO / DEFAULT_MODEL)!r})
        big.exp()  # the loading thread holds a pool, as Triton's stub thread does
        loaded = threads()
        engine = Engine(model)
        engine.start()
        greedy = SamplingParams(max_tokens=4, min_tokens=4, top_k=1)
        out = engine.generate(list(range(10, 200)), greedy)
        idle = settle(base + 1)  # + the engine thread
        busy = []
        def probe(o):
            busy.append(threads())
        from backend.engine import Request
        done = threading.Event()
        def on_output(o):
            probe(o)
            if o.finished:
                done.set()
        engine.submit(Request("r2", list(range(20, 220)), greedy, on_output=on_output))
        done.wait(60)
        engine.stop()
        print(json.dumps(dict(base=base, loaded=loaded, idle=idle, busy=max(busy),
                              tokens=len(out.new_token_ids))))
    """)
    assert out["tokens"] == 4
    assert out["loaded"] >= out["base"] + 1
    assert out["idle"] == out["base"] + 1  # the engine thread alone
    assert out["busy"] == out["base"] + 2  # the engine thread and its one worker
