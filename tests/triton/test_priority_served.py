"""Request priority through the real tritonserver (the ensemble's `priority` input, lower runs
first): with one running slot, an urgent request sent while a long one runs is answered
first, taking the long one's slot (a preemption: the long one recomputes and its text is the
same as alone), and a request of the long one's priority waits until it is done."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from client.generate import GenerateParams, stream_grpc
from tests.triton.conftest import LLM_MODELS
from tests.triton.llm_helpers import scrape, value

LONG = 400


@pytest.fixture(scope="module")
def one_slot(triton_server):
    return triton_server(LLM_MODELS, {"hybrid_llm": {
        "num_kv_pages": "256", "max_context_len": "2048", "max_num_seqs": "1"}})


def _params(prompt: str, tokens: int, priority: int | None) -> GenerateParams:
    return GenerateParams(prompt, max_tokens=tokens, min_tokens=tokens, top_k=1,
                          priority=priority, cache_salt=uuid.uuid4().hex)


def test_an_urgent_request_is_served_before_a_long_running_one(one_slot):
    url = one_slot.urls.grpc
    long_prompt = "Once upon a time there was a long story to tell, and"
    alone = "".join(c.text for c in stream_grpc(url, _params(long_prompt, LONG, 5)))
    before = value(scrape(one_slot), "suffixreplay_preemptions_total")
    finished: dict[str, float] = {}
    texts: dict[str, str] = {}
    started = threading.Event()

    def run(name: str, params: GenerateParams) -> None:
        parts = []
        for chunk in stream_grpc(url, params):
            parts.append(chunk.text)
            started.set()
        texts[name] = "".join(parts)
        finished[name] = time.perf_counter()

    threads = {"long": threading.Thread(target=run, args=("long", _params(long_prompt, LONG,
                                                                          5)))}
    threads["long"].start()
    assert started.wait(60), "the long request produced nothing"
    threads["same"] = threading.Thread(target=run, args=("same", _params("Hello", 4, 5)))
    threads["same"].start()
    time.sleep(0.3)  # queued behind the long one
    threads["urgent"] = threading.Thread(target=run, args=("urgent", _params("Hi", 4, 0)))
    threads["urgent"].start()
    for thread in threads.values():
        thread.join(120)
    assert set(finished) == {"long", "same", "urgent"}
    assert finished["urgent"] < finished["long"] < finished["same"]
    assert texts["long"] == alone  # preempted and recomputed: the same greedy text
    assert value(scrape(one_slot), "suffixreplay_preemptions_total") == before + 1
