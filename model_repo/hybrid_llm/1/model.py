"""Triton Python model `hybrid_llm` (decoupled): the engine thread and its response streams.

The logic lives in backend/triton/hybrid_llm.py; this file only maps Triton's entry points.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backend.triton.hybrid_llm import HybridLlm
from backend.triton.responses import python_model

TritonPythonModel = python_model(pb_utils, HybridLlm)
