from __future__ import annotations

import os
import shutil
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


def _aot_build_of(tmp_path_factory, family: str):
    """A small random checkpoint of `family` (tests/engine/engine_helpers.FAMILIES; seed 4,
    the byte tokenizer's vocabulary) built with `build.py --backend aot`: (model dir, engine
    dir, model repository)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from engine_helpers import family_checkpoint

    from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO
    from engine_build import build

    root = tmp_path_factory.mktemp(f"aot-{family}")
    model_dir = root / family
    family_checkpoint(model_dir, family, seed=4, vocab_size=260)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (model_dir / name).exists():
            shutil.copy2(MODEL_REPO / DEFAULT_MODEL / name, model_dir / name)
    code = build.main(["--model", str(model_dir), "--repo", str(root / "repo"),
                       "--backend", "aot"])
    assert code == 0
    return model_dir, model_dir / "aot", root / "repo"


@pytest.fixture(scope="session")
def aot_build_nemotron_h(tmp_path_factory):
    """`aot_build` for a small random Nemotron-H checkpoint (Mamba2, attention and MLP
    layers)."""
    return _aot_build_of(tmp_path_factory, "nemotron_h")


@pytest.fixture(scope="session")
def aot_build_nemotron_h_moe(tmp_path_factory):
    """`aot_build` for a Nemotron-H checkpoint with mixture-of-experts layers."""
    return _aot_build_of(tmp_path_factory, "nemotron_h_moe")


@pytest.fixture(scope="session")
def aot_build_qwen3_next_moe(tmp_path_factory):
    """`aot_build` for a Qwen3-Next checkpoint with sparse MoE MLPs."""
    return _aot_build_of(tmp_path_factory, "qwen3_next_moe")
