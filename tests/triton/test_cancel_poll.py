"""The cancellation watcher never asks a finished request's sender whether it was cancelled:
Triton frees a response factory once its final response is sent, and asking it then crashes
tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled; a 3-minute soak with 32
clients hit it). A watcher polling every millisecond over 24 clients' short requests widens
the race: without the guard (`GuardedSender`) this test crashed the server in 3 of 4 runs."""

from __future__ import annotations

import threading

from backend.triton.server import ServerHandle
from client.generate import GenerateParams, stream_grpc
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS

CLIENTS, REQUESTS_EACH = 24, 25


def test_polling_for_cancellation_beside_finishing_requests_keeps_the_server_up(
    triton_server,
):
    params = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "cancellation_check_period_ms": "1"}}
    server: ServerHandle = triton_server(LLM_MODELS, params)
    done: list[int] = []
    errors: list[str] = []

    def client(c: int) -> None:
        for i in range(REQUESTS_EACH):
            request = GenerateParams(f"poll {c} {i}", max_tokens=2, min_tokens=2, top_k=1)
            try:
                chunks = list(stream_grpc(server.urls.grpc, request, timeout_s=60))
            except Exception as exc:  # noqa: BLE001 - a dead server shows as errors here
                errors.append(repr(exc)[:200])
                return
            done.append(sum(ch.counts.get("num_output_tokens", 0) for ch in chunks))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    crash = [line for line in server.logs().splitlines() if "Signal" in line or "# " in line]
    assert server.is_alive(), crash[:8]
    assert not errors, errors[:3]
    assert done == [2] * (CLIENTS * REQUESTS_EACH)
