"""Cancelling a generation that runs inside the ensemble.

Triton (2.51) checks an ensemble request for cancellation only between steps: it marks the next
step's request cancelled but never the decoupled `hybrid_llm` request that is already running,
so the engine would go on to max_tokens for a client that left. The first request that sees the
cancellation is therefore the postprocessing request made from hybrid_llm's next response.
Postprocessing gets the engine's request id with it (`REQUEST_KEY`, from hybrid_llm's
`request_key` output) and sends hybrid_llm a BLS request with `stop` = true under that id,
TensorRT-LLM's way of stopping a request; hybrid_llm cancels it in the engine, which frees its
pages. A non-streaming request has no next response before it ends, so it runs to completion.

Found by experiment with Triton 2.51: postprocessing must have no dynamic batcher (it fails a
cancelled request before `execute` sees it), and must answer the cancelled request normally:
an error from that step while the decoupled step is still open leaves the ensemble request
in flight forever (the server then waits for it at shutdown).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from backend.triton.responder import log

ENGINE_MODEL = "hybrid_llm"


def request_key(request: Any) -> str | None:
    """The engine request id a postprocessing request carries, if any."""
    for tensor in request.inputs():
        if tensor.name() == "REQUEST_KEY":
            value = tensor.as_numpy().reshape(-1)
            return value[0].decode("utf-8") if value.size else None
    return None


def is_cancelled(request: Any) -> bool:
    check = getattr(request, "is_cancelled", None)
    return bool(check()) if check is not None else False


def stop_generation(pb_utils: ModuleType, key: str, model: str = ENGINE_MODEL) -> None:
    """Asks `model` to cancel its open request `key` (dummy values fill its required inputs)."""
    inputs = [
        pb_utils.Tensor("input_ids", np.zeros((1, 1), dtype=np.int32)),
        pb_utils.Tensor("input_lengths", np.ones((1, 1), dtype=np.int32)),
        pb_utils.Tensor("request_output_len", np.ones((1, 1), dtype=np.int32)),
        pb_utils.Tensor("stop", np.ones((1, 1), dtype=np.bool_)),
    ]
    request = pb_utils.InferenceRequest(
        model_name=model, inputs=inputs, requested_output_names=[], request_id=key
    )
    for response in request.exec(decoupled=True):
        if response.has_error():
            log(pb_utils, f"stopping {key} in {model} failed: {response.error().message()}", "warn")


def stop_cancelled(pb_utils: ModuleType, requests: list[Any]) -> int:
    """Stops the generation of every cancelled request; returns how many were cancelled."""
    num_cancelled = 0
    for request in requests:
        if not is_cancelled(request):
            continue
        num_cancelled += 1
        try:  # (an error here would fail the whole batch and leave the stream hanging)
            key = request_key(request)
            if key is not None:
                stop_generation(pb_utils, key)
        except Exception as e:  # noqa: BLE001 - e.g. the server stopping, a key not UTF-8
            log(pb_utils, f"stopping a cancelled request's generation failed: {e!r}", "warn")
    return num_cancelled
