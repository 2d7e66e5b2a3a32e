"""Triton Python model `hybrid_llm_bls` (decoupled): the ensemble's pipeline in one model.

The logic lives in backend/triton/bls.py; this file only maps Triton's entry points.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backend.triton.bls import HybridLlmBls
from backend.triton.errors import ConfigError


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        try:
            self.model = HybridLlmBls(pb_utils, args)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(str(exc)) from exc

    def execute(self, requests: list) -> None:
        self.model.execute(requests)

    def finalize(self) -> None:
        self.model.finalize()
