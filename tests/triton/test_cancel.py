"""A client that cancels mid-stream stops its generation and releases its pages, through the
ensemble (postprocessing forwards the cancellation as `stop`; a gRPC stream cancelled or an
HTTP `generate_stream` connection closed) and on hybrid_llm directly."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.triton.server import ServerHandle
from client.generate import GenerateParams, stream_grpc, stream_http
from client.metrics import value
from tests.triton.llm_helpers import idle_pool, long_prompt, pool_state, scrape, wait_until

# Far more tokens than the test waits for: only a cancellation ends the request in time.
MAX_TOKENS = 1800


def test_cancel_through_the_ensemble_releases_pages(llm_server: ServerHandle):
    before = idle_pool(llm_server)
    prompt = long_prompt("Cancel me after three tokens", 150)
    params = GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, seed=3)
    stream = stream_grpc(llm_server.urls.grpc, params)
    chunks = [next(stream) for _ in range(3)]
    # The request holds pages now (the metrics it is read from lag the engine by ~0.1 s).
    wait_until(lambda: pool_state(llm_server)["held_by_requests"] > 0, 10, "held pages")
    stream.close()  # cancels the gRPC request
    after = idle_pool(llm_server, timeout_s=20)
    assert len(chunks) == 3
    assert "stopped (stop=true)" in llm_server.logs()
    assert after["held_by_requests"] == 0
    assert after["free_or_cached"] == before["free_or_cached"]


def test_cancelling_a_streamed_beam_search_stops_it(llm_server: ServerHandle):
    """A streamed beam search sends a response per step, so its cancellation reaches it
    the same way (not streamed, it would run to its end)."""
    before = idle_pool(llm_server)
    stops = llm_server.logs().count("stopped (stop=true)")
    prompt = long_prompt("Beams to cancel", 100)
    params = GenerateParams(prompt, max_tokens=600, min_tokens=600, beam_width=3)
    stream = stream_grpc(llm_server.urls.grpc, params)
    chunks = [next(stream) for _ in range(3)]
    wait_until(lambda: pool_state(llm_server)["held_by_requests"] > 0, 10, "held pages")
    stream.close()
    wait_until(lambda: llm_server.logs().count("stopped (stop=true)") > stops, 20, "a stop")
    after = idle_pool(llm_server, timeout_s=20)
    assert [len(c.texts) for c in chunks] == [3, 3, 3] and not any(c.final for c in chunks)
    assert after["held_by_requests"] == 0
    assert after["free_or_cached"] == before["free_or_cached"]


def test_closing_an_http_stream_stops_the_generation(llm_server: ServerHandle):
    """Triton marks a generate_stream request cancelled when its client disconnects; the
    ensemble's next postprocessing step forwards it as `stop`, as for gRPC."""
    before = idle_pool(llm_server)
    stops = llm_server.logs().count("stopped (stop=true)")

    def cancelled() -> float:
        return value(scrape(llm_server), "suffixreplay_unfinished_requests_total",
                     reason="cancelled")

    cancelled_before = cancelled()
    prompt = long_prompt("Hang up on me", 150)
    params = GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, seed=4)
    stream = stream_http(llm_server.urls.http, params)
    chunks = [next(stream) for _ in range(3)]
    wait_until(lambda: pool_state(llm_server)["held_by_requests"] > 0, 10, "held pages")
    stream.close()  # closes the connection
    wait_until(lambda: llm_server.logs().count("stopped (stop=true)") > stops, 20, "a stop")
    after = idle_pool(llm_server, timeout_s=20)
    assert len(chunks) == 3 and all(not c.final for c in chunks)
    wait_until(lambda: cancelled() == cancelled_before + 1, 10, "the cancelled-requests metric")
    assert after["held_by_requests"] == 0
    assert after["free_or_cached"] == before["free_or_cached"]


def _inputs(tensors: dict[str, np.ndarray]) -> list:
    """hybrid_llm's inputs (INT32, BOOL) as gRPC InferInputs."""
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(
            name, list(array.shape), "BOOL" if array.dtype == bool else "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _streaming_inputs(seed: str) -> list:
    """A streamed hybrid_llm request of a 100-byte prompt that runs MAX_TOKENS tokens."""
    ids = np.frombuffer(long_prompt(seed, 100).encode(), dtype=np.uint8)
    return _inputs({
        "input_ids": ids.astype(np.int32)[None],
        "input_lengths": np.array([[ids.size]], dtype=np.int32),
        "request_output_len": np.array([[MAX_TOKENS]], dtype=np.int32),
        "min_tokens": np.array([[MAX_TOKENS]], dtype=np.int32),
        "streaming": np.array([[True]]),
    })


def test_cancel_on_hybrid_llm_directly(llm_server: ServerHandle):
    before = idle_pool(llm_server)
    inputs = _streaming_inputs("Direct cancel")
    client = grpcclient.InferenceServerClient(llm_server.urls.grpc)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("hybrid_llm", inputs)
    for _ in range(3):
        result, error = responses.get(timeout=60)
        assert error is None, error
        assert result.as_numpy("output_ids").shape == (1, 1, 1)
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_until(lambda: "cancelled by its client" in llm_server.logs(), 20, "the cancel log")
    after = idle_pool(llm_server, timeout_s=20)
    assert after["free_or_cached"] == before["free_or_cached"]


def _stop(llm_server: ServerHandle, request_id: str):
    """A `stop` = true request to hybrid_llm under `request_id` (its dummy inputs unread)."""
    tensors = {
        "input_ids": np.zeros((1, 1), dtype=np.int32),
        "input_lengths": np.ones((1, 1), dtype=np.int32),
        "request_output_len": np.ones((1, 1), dtype=np.int32),
        "stop": np.array([[True]]),
    }
    inputs = _inputs(tensors)
    client = grpcclient.InferenceServerClient(llm_server.urls.grpc)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("hybrid_llm", inputs, request_id=request_id,
                              enable_empty_final_response=True)
    result, error = responses.get(timeout=60)
    client.stop_stream()
    client.close()
    return error


def test_a_stop_reaches_only_the_request_it_names(llm_server: ServerHandle):
    """As TensorRT-LLM's: a `stop` without a request id is refused, and a request sent
    without one cannot be named (a stop for "req" used to end every such request)."""
    stops = llm_server.logs().count("stopped (stop=true)")
    error = _stop(llm_server, "")
    assert error is not None and "a request id must be provided" in str(error)
    prompt = long_prompt("Nobody may stop me", 120)
    stream = stream_grpc(llm_server.urls.grpc, GenerateParams(
        prompt, max_tokens=40, min_tokens=40, seed=5))
    first = next(stream)
    for key in ("req", "", "#"):
        if key:
            assert _stop(llm_server, key) is None  # nothing by that id: answered, no effect
    rest = list(stream)
    assert rest[-1].final and rest[-1].finish_reasons == ["length"]
    assert not first.final
    assert llm_server.logs().count("stopped (stop=true)") == stops


def test_a_stopped_request_is_told_why_it_ended(llm_server: ServerHandle):
    """`stop` from another client, as TensorRT-LLM's: the stopped request's stream ends with a
    response whose finish_reason is "cancelled" (it was a bare final flag, which looks like
    nothing to a gRPC client, and an end without a reason to one that asks for empty finals)."""
    inputs = _streaming_inputs("Stop me by name")
    client = grpcclient.InferenceServerClient(llm_server.urls.grpc)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("hybrid_llm", inputs, request_id="stop-me",
                              enable_empty_final_response=True)
    for _ in range(3):
        result, error = responses.get(timeout=60)
        assert error is None, error
    assert _stop(llm_server, "stop-me") is None
    reasons = []
    while True:
        result, error = responses.get(timeout=60)
        assert error is None, error
        reasons.append(result.as_numpy("finish_reason").reshape(-1)[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert reasons[-1] == "cancelled" and not any(reasons[:-1])
    idle_pool(llm_server, timeout_s=20)


@pytest.mark.parametrize("shape", ["two_sequences", "two_prompts", "unsubmitted_sibling",
                                   "beam_search"])
def test_each_sequence_of_a_stopped_request_is_told_why_it_ended(llm_server: ServerHandle,
                                                                    shape: str):
    """A stopped request of several sequences (num_return_sequences) or prompts (a batched
    request) ended with a bare final flag (a gRPC client without empty final responses waits
    for an end it never sees); now each sequence's last response says "cancelled", the
    request's last one carrying the final flag. A sibling stopped before it was submitted
    (the stop comes before the first sequence's first token) ends too. A stopped beam search
    ends with its running beams so far, each "cancelled" (it was a bare final flag)."""
    early = shape == "unsubmitted_sibling"  # (a long prompt: a first token that takes time)
    ids = np.frombuffer(long_prompt(f"Stop us {shape}", 1500 if early else 100).encode(),
                        dtype=np.uint8)
    rows, length = 2 if shape == "two_prompts" else 1, 300 if early else MAX_TOKENS
    tensors = {
        "input_ids": np.repeat(ids.astype(np.int32)[None], rows, 0),
        "input_lengths": np.full((rows, 1), ids.size, dtype=np.int32),
        "request_output_len": np.full((rows, 1), length, dtype=np.int32),
        "min_tokens": np.full((rows, 1), length, dtype=np.int32),
        "streaming": np.full((rows, 1), True),
    }
    if shape == "beam_search":
        tensors["beam_width"] = np.full((rows, 1), 2, dtype=np.int32)
    elif shape != "two_prompts":
        tensors["num_return_sequences"] = np.full((rows, 1), 2, dtype=np.int32)
    client = grpcclient.InferenceServerClient(llm_server.urls.grpc)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    rid = f"stop-us-{shape}"
    client.async_stream_infer("hybrid_llm", _inputs(tensors), request_id=rid,
                              enable_empty_final_response=True)
    if early:  # a stop as soon as the request is open
        stops = llm_server.logs().count("stopped (stop=true)")
        for _ in range(500):
            assert _stop(llm_server, rid) is None
            if llm_server.logs().count("stopped (stop=true)") > stops:
                break
            assert responses.empty(), responses.get()  # (an error: nothing to stop)
        else:
            raise AssertionError("the request was never open to a stop")
    else:
        for _ in range(4):
            result, error = responses.get(timeout=60)
            assert error is None, error
        assert _stop(llm_server, rid) is None
    ended = []
    while True:
        result, error = responses.get(timeout=60)
        assert error is None, error
        final = result.get_response().parameters["triton_final_response"].bool_param
        reasons = result.as_numpy("finish_reason")
        assert reasons is not None, "a bare final flag"
        ended += [r.decode() for r in reasons.reshape(-1) if r]
        if final:
            break
    client.stop_stream()
    client.close()
    assert ended == ["cancelled", "cancelled"]
    idle_pool(llm_server, timeout_s=20)


class _Request:
    """What stop_cancelled reads of a postprocessing request: is_cancelled and REQUEST_KEY."""

    def __init__(self, key: bytes, cancelled: bool = True) -> None:
        self.key, self.cancelled = key, cancelled

    def is_cancelled(self) -> bool:
        return self.cancelled

    def inputs(self) -> list:
        tensor = type("T", (), {"name": lambda _: "REQUEST_KEY",
                                "as_numpy": lambda _: np.array([[self.key]], dtype=object)})
        return [tensor()]


def test_a_stop_that_fails_leaves_the_batch_answered(capsys):
    """The BLS stop request failing (the server stopping) or a key that is no UTF-8 is logged;
    the other requests of the batch are still stopped (an exception would fail the batch)."""
    sent = []

    class Stub:  # pb_utils' two calls, the first one failing
        Tensor = staticmethod(lambda name, value: (name, value))

        class InferenceRequest:
            def __init__(self, request_id: str, **_) -> None:
                self.request_id = request_id

            def exec(self, decoupled: bool):
                if self.request_id == "a":
                    raise RuntimeError("server is stopping")
                sent.append(self.request_id)
                return []

    from backend.triton.cancel import stop_cancelled
    requests = [_Request(b"a"), _Request(b"\xff"), _Request(b"c", cancelled=False), _Request(b"d")]
    assert stop_cancelled(Stub, requests) == 3
    assert sent == ["d"]
    logged = capsys.readouterr().out
    assert "server is stopping" in logged and "UnicodeDecodeError" in logged
