from __future__ import annotations

import os
import sys
from pathlib import Path

# The Triton kernels run through Triton's interpreter on CPU-only machines; this must be set
# before anything imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "model"))

# Two cores: keep intra-op threads fixed so timings and results are repeatable.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def aot_engine(tmp_path_factory):
    """The default tiny model compiled once per session by engine_build/aot.py (CPU)."""
    from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO
    from engine_build.aot import build_aot_engine

    model_dir = MODEL_REPO / DEFAULT_MODEL
    out = tmp_path_factory.mktemp("aot") / "engine"
    return model_dir, build_aot_engine(model_dir, out, progress=False)
