"""A Qwen3-Next checkpoint (packed Gated DeltaNet projections, sparse MoE MLPs) built with
engine_build/build.py and served by tritonserver: the ensemble returns what the in-process
engine generates, a branch of a served prompt hits the cache with its states replayed; the
same through the AOT engine `--backend aot` compiles (experts through `moe_experts`)."""

from __future__ import annotations

import shutil

import pytest
from hf_oracle import QWEN3_NEXT_CONFIGS, make_hf_checkpoint

from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO
from engine_build import build
from tests.triton.llm_helpers import (
    assert_built_repository_serves_as_eager,
    assert_prompt_and_branch_served_as_generated,
    serve_checkpoint,
)

pytest.importorskip("transformers")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-next") / "ckpt"
    make_hf_checkpoint(path, seed=6, family="qwen3_next", vocab_size=260,
                       **QWEN3_NEXT_CONFIGS["moe"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(MODEL_REPO / DEFAULT_MODEL / name, path / name)
    return path


def test_build_accepts_qwen3_next(qwen3_next_dir, tmp_path, capsys):
    assert build.main(["--model", str(qwen3_next_dir), "--repo", str(tmp_path / "repo")]) == 0
    assert "qwen3_next" in capsys.readouterr().out
    # No TensorRT plugin routes experts: refused before TensorRT is looked for.
    assert build.main(["--model", str(qwen3_next_dir), "--repo", str(tmp_path / "trt"),
                       "--backend", "tensorrt"]) != 0
    assert "mixture-of-experts" in capsys.readouterr().err


def test_served_compiled_qwen3_next_matches_the_eager_engine(triton_server,
                                                             aot_build_qwen3_next_moe):
    """The repository `build.py --backend aot` wrote for a Qwen3-Next MoE checkpoint, served
    as written: the compiled engine generates what the eager engine does, a branch hits."""
    counts = assert_built_repository_serves_as_eager(
        triton_server, aot_build_qwen3_next_moe, "Compiled experts route each token", MAX_TOKENS)
    assert counts["cached_tokens"] >= 128


def test_served_qwen3_next_matches_the_engine_and_hits_the_cache(triton_server, qwen3_next_dir):
    server, engine = serve_checkpoint(triton_server, qwen3_next_dir)
    counts = assert_prompt_and_branch_served_as_generated(
        server, engine, "Sparse experts route each token", MAX_TOKENS)
    assert counts["cached_tokens"] >= 128 and counts["replayed_anchors"] > 0
