"""What the soak watches on the server: resident memory of the server and its model processes,
page-pool use, and idleness."""

from __future__ import annotations

import time
from pathlib import Path

from backend.triton.server import ServerHandle
from client.metrics import page_pool, scrape, value


def descendants(pid: int) -> list[int]:
    """pid and every process below it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def server_rss_bytes(server: ServerHandle) -> int:
    """tritonserver plus its Python model stubs (the engine lives in hybrid_llm's)."""
    return sum(rss_bytes(pid) for pid in descendants(server.process.pid))


def pool_use(server: ServerHandle) -> dict[str, float]:
    return page_pool(scrape(server.urls.metrics))


def wait_idle(server: ServerHandle, timeout_s: float = 120.0) -> None:
    """Until no request is open and no page is held (metrics refresh every ~0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape(server.urls.metrics)
        active = value(m, "nv_trt_llm_request_metrics", request_type="active")
        if active == 0 and page_pool(m).get("held_by_requests", 0) == 0:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the server did not become idle within {timeout_s} s")
