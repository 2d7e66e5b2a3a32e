"""Triton Python model `hybrid_llm_bls` (decoupled): the ensemble's pipeline in one model.

The logic lives in backend/triton/bls.py; this file only maps Triton's entry points.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backend.triton.bls import HybridLlmBls
from backend.triton.responses import python_model

TritonPythonModel = python_model(pb_utils, HybridLlmBls)
