"""Glue between `triton_python_backend_utils` and the numpy-only logic of the models.

`pb_utils` is passed in rather than imported: it exists only inside the Python backend stub,
and its classes (TritonError, InferenceResponse...) are attached by the stub at run time.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from backend.triton.errors import ConfigError, RequestError

Handler = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def request_inputs(request: Any) -> dict[str, np.ndarray]:
    """All input tensors of one request by name (absent optional inputs are simply missing)."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def error_code(pb_utils: ModuleType, name: str) -> int | None:
    """A TritonError code constant (`INVALID_ARG`, `INTERNAL`); None on stubs without codes."""
    return getattr(pb_utils.TritonError, name, None)


def error_response(pb_utils: ModuleType, message: str, code_name: str) -> Any:
    code = error_code(pb_utils, code_name)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def respond(pb_utils: ModuleType, requests: Sequence[Any], handler: Handler) -> list[Any]:
    """One response per request; a failing request gets an error response, the rest go on."""
    responses = []
    for request in requests:
        try:
            outputs = handler(request_inputs(request))
        except RequestError as exc:
            responses.append(error_response(pb_utils, str(exc), "INVALID_ARG"))
            continue
        except Exception as exc:  # a bug must fail this request, not the model instance
            _log_error(pb_utils, traceback.format_exc())
            responses.append(error_response(pb_utils, f"internal error: {exc!r}", "INTERNAL"))
            continue
        tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
        responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
    return responses


def _log_error(pb_utils: ModuleType, message: str) -> None:
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_error(message)
    else:
        print(message, flush=True)


def python_model(pb_utils: ModuleType, impl: Callable[[ModuleType, Mapping[str, str]], Any],
                 ) -> type:
    """The `TritonPythonModel` class of a decoupled model whose logic is `impl(pb_utils,
    args)` (with `execute(requests)` and `finalize()`): a bad configuration (`ConfigError`)
    fails the model's load with its message."""

    class TritonPythonModel:
        def initialize(self, args: dict[str, str]) -> None:
            try:
                self.model = impl(pb_utils, args)
            except ConfigError as exc:
                raise pb_utils.TritonModelException(str(exc)) from exc

        def execute(self, requests: list) -> None:
            self.model.execute(requests)

        def finalize(self) -> None:
            self.model.finalize()

    return TritonPythonModel
