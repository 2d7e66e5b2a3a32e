"""`max_queue_size` through the real tritonserver: with one running slot and room for one
waiting request, a third request is refused at once (gRPC stream error, an error from the
HTTP generate endpoint, 503 `service_unavailable` from the OpenAI frontend), counted in
`suffixreplay_rejected_requests_total`, and the two accepted requests finish unchanged."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from client.generate import GenerateError, GenerateParams, stream_grpc, stream_grpc_batch
from tests.triton.conftest import LLM_MODELS
from tests.triton.llm_helpers import running_frontend, scrape, value

LONG = 1900  # decoding all the while the test looks (cancelled at the end)


@pytest.fixture(scope="module")
def small_queue(triton_server):
    return triton_server(LLM_MODELS, {"hybrid_llm": {
        "num_kv_pages": "256", "max_context_len": "2048", "max_num_seqs": "1",
        "max_queue_size": "1"}})


def _params(prompt: str, tokens: int) -> GenerateParams:
    return GenerateParams(prompt, max_tokens=tokens, min_tokens=tokens, top_k=1,
                          cache_salt=uuid.uuid4().hex)


def _http_generate(server, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"{server.urls.http}/v2/models/ensemble/generate",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class _Busy:
    """A long request in the one slot (until `stop`: its stream closed, which cancels it) and
    a short one waiting behind it (threads)."""

    def __init__(self, url: str) -> None:
        self.texts: dict[str, str] = {}
        self.errors: list[Exception] = []
        self.stop = threading.Event()
        started = threading.Event()

        def run(name: str, params: GenerateParams) -> None:
            parts = []
            try:
                for chunk in stream_grpc(url, params):
                    parts.append(chunk.text)
                    started.set()
                    if name == "long" and self.stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
            self.texts[name] = "".join(parts)

        self.threads = [threading.Thread(target=run, args=("long", _params("Once upon a",
                                                                           LONG)))]
        self.threads[0].start()
        assert started.wait(60), "the long request produced nothing"
        self.threads.append(threading.Thread(target=run, args=("queued", _params("Hi", 4))))
        self.threads[1].start()
        time.sleep(1.0)  # the engine took it into its queue (a step drains its inbox)

    def join(self) -> None:
        assert self.threads[0].is_alive(), "the long request ended before the checks"
        self.stop.set()
        for thread in self.threads:
            thread.join(180)
        assert not self.errors, self.errors
        assert set(self.texts) == {"long", "queued"}


def _refused(small_queue) -> float:
    return value(scrape(small_queue), "suffixreplay_rejected_requests_total",
                 reason="queue_full")


def test_a_request_past_the_queue_limit_is_refused(small_queue, tmp_path):
    url = small_queue.urls.grpc
    alone = "".join(c.text for c in stream_grpc(url, _params("Hi", 4)))
    before = _refused(small_queue)
    with running_frontend(small_queue, tmp_path / "frontend.log") as frontend:
        busy = _Busy(url)
        with pytest.raises(GenerateError, match="request queue is full"):
            list(stream_grpc(url, _params("Hello there", 4)))
        status, body = _http_generate(small_queue, {"text_input": "Hello", "max_tokens": 4})
        # the model's error is UNAVAILABLE; this Triton's generate endpoint answers every
        # model error with 400 (the OpenAI frontend below says 503)
        assert status in (400, 503) and "request queue is full" in body, (status, body)
        request = urllib.request.Request(
            f"{frontend}/v1/completions",
            json.dumps({"model": "ensemble", "prompt": "Hello", "max_tokens": 4}).encode(),
            {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=120)
        assert refused.value.code == 503
        error = json.loads(refused.value.read())["error"]
        assert "request queue is full" in error["message"], error
        assert error["type"] == "service_unavailable"
        busy.join()
    assert busy.texts["queued"] == alone  # the accepted request: as alone
    assert _refused(small_queue) == before + 3
    # the queue drained: requests are taken again
    assert "".join(c.text for c in stream_grpc(url, _params("Hi", 4))) == alone


def test_a_batch_counts_once_against_the_queue_limit(small_queue):
    """max_queue_size 1 on an idle server: a batch of three prompts is one request, so all
    three are queued and answered (as each alone), none refused."""
    url = small_queue.urls.grpc
    params = [_params(p, 4) for p in ("Hi", "Hello", "Hey there")]
    before = _refused(small_queue)
    chunks = list(stream_grpc_batch(url, params))
    texts = {b: "".join(c.text for c in chunks if c.batch_index == b) for b in range(3)}
    assert texts == {b: "".join(c.text for c in stream_grpc(url, p))
                     for b, p in enumerate(params)}
    assert _refused(small_queue) == before


def test_a_replica_with_a_full_queue_hands_the_request_to_the_next(small_queue, llm_server,
                                                                    tmp_path):
    """Two replicas behind the frontend's router, the first with its queue full: every
    request is answered (by the second), the first refused some, and it is not marked down
    (a full queue is no failure)."""
    before = _refused(small_queue)
    with running_frontend(small_queue, tmp_path / "router.log", "--triton-url",
                          llm_server.urls.grpc, "--router-down-s", "60",
                          first_url=small_queue.urls.grpc) as frontend:
        busy = _Busy(small_queue.urls.grpc)
        for i in range(4):
            request = urllib.request.Request(
                f"{frontend}/v1/completions",
                json.dumps({"model": "ensemble", "prompt": f"{uuid.uuid4().hex} {i}",
                            "max_tokens": 3, "top_k": 1}).encode(),
                {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as resp:
                assert json.loads(resp.read())["choices"][0]["finish_reason"] == "length"
        with urllib.request.urlopen(f"{frontend}/router") as resp:
            full, other = json.loads(resp.read())["replicas"]
        busy.join()
    assert _refused(small_queue) >= before + 1  # ties went to the full one first
    assert full["up"] and full["failures"] == 0
    assert other["up"] and other["routed"] == 4
