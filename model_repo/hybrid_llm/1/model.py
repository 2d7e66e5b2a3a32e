"""Triton Python model `hybrid_llm` (decoupled): the engine thread and its response streams.

The logic lives in backend/triton/hybrid_llm.py; this file only maps Triton's entry points.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backend.triton.errors import ConfigError
from backend.triton.hybrid_llm import HybridLlm


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        try:
            self.model = HybridLlm(pb_utils, args)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(str(exc)) from exc

    def execute(self, requests: list) -> None:
        self.model.execute(requests)

    def finalize(self) -> None:
        self.model.finalize()
