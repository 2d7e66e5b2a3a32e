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
def aot_build(tmp_path_factory):
    """A copy of the default tiny model built once per session with
    `engine_build/build.py --backend aot` (CPU): (model dir, engine dir, model repository)."""
    import shutil

    from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO
    from engine_build import build

    root = tmp_path_factory.mktemp("aot")
    model_dir = root / "tiny"
    shutil.copytree(MODEL_REPO / DEFAULT_MODEL, model_dir)
    code = build.main(["--model", str(model_dir), "--repo", str(root / "repo"),
                       "--backend", "aot"])
    assert code == 0
    return model_dir, model_dir / "aot", root / "repo"


@pytest.fixture(scope="session")
def aot_engine(aot_build):
    """(model dir, compiled engine dir) of `aot_build`."""
    return aot_build[0], aot_build[1]


@pytest.fixture(scope="session")
def aot_build_nemotron_h(tmp_path_factory):
    """`aot_build` for a small random Nemotron-H checkpoint (Mamba2, attention and MLP
    layers; the byte tokenizer's vocabulary): (model dir, engine dir, model repository)."""
    pytest.importorskip("transformers")
    from hf_oracle import make_nemotron_h_checkpoint

    from engine_build import build

    root = tmp_path_factory.mktemp("aot-nemotron-h")
    model_dir = root / "nemotron_h"
    make_nemotron_h_checkpoint(model_dir, seed=4, vocab_size=260)
    code = build.main(["--model", str(model_dir), "--repo", str(root / "repo"),
                       "--backend", "aot"])
    assert code == 0
    return model_dir, model_dir / "aot", root / "repo"
