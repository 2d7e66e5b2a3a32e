"""A Nemotron-H (Mamba2) checkpoint, dense and with MoE layers, built with
engine_build/build.py (eager and AOT) and served by tritonserver: the ensemble returns what
the in-process engine generates, and a repeated prefix hits the cache (suffix replay of the
Mamba2 groups)."""

from __future__ import annotations

import pytest
from hf_oracle import NEMOTRON_H_CONFIGS, make_nemotron_h_checkpoint

from backend.engine import SamplingParams
from client.generate import GenerateParams, generate_http, stream_grpc
from engine_build import build
from tests.triton.llm_helpers import (
    assert_built_repository_serves_as_eager,
    long_prompt,
    serve_checkpoint,
)

pytest.importorskip("transformers")
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["dense", "moe"])
def nemotron_dir(request, tmp_path_factory):
    """A dense Nemotron-H checkpoint, and one with mixture-of-experts layers."""
    path = tmp_path_factory.mktemp(f"nemotron-h-{request.param}")
    layout = NEMOTRON_H_CONFIGS["moe-latent"] if request.param == "moe" else {}
    make_nemotron_h_checkpoint(path, seed=4, vocab_size=260, **layout)  # the byte tokenizer
    return path


def test_build_accepts_nemotron_h_for_eager(nemotron_dir, tmp_path, capsys):
    assert build.main(["--model", str(nemotron_dir), "--repo", str(tmp_path / "repo")]) == 0
    assert "nemotron_h" in capsys.readouterr().out
    config = (tmp_path / "repo" / "hybrid_llm" / "config.pbtxt").read_text()
    assert str(nemotron_dir) in config
    # TensorRT registers Qwen3.5's operators only: refused before TensorRT is looked for.
    assert build.main(["--model", str(nemotron_dir), "--repo", str(tmp_path / "trt"),
                       "--backend", "tensorrt"]) != 0
    assert "--backend aot or eager" in capsys.readouterr().err


@pytest.mark.parametrize("build_fixture", ["aot_build_nemotron_h", "aot_build_nemotron_h_moe"])
def test_served_compiled_nemotron_h_matches_the_eager_engine(triton_server, request,
                                                             build_fixture):
    """The repository `build.py --backend aot` wrote for a Nemotron-H checkpoint (dense, and
    with MoE layers), served as written: the compiled engine (Mamba2 through `ssd_scan`,
    experts through `moe_experts`) generates what the eager engine does, and a branch of a
    served prompt hits its pages."""
    counts = assert_built_repository_serves_as_eager(
        triton_server, request.getfixturevalue(build_fixture), "A compiled Mamba2 engine",
        MAX_TOKENS)
    assert counts["cached_tokens"] >= 128


def test_served_nemotron_h_matches_the_engine_and_hits_the_cache(triton_server, nemotron_dir):
    server, engine = serve_checkpoint(triton_server, nemotron_dir)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1)
    prompt = long_prompt("Mamba2 layers keep a state", 200)
    request = GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1)
    ids = engine.tokenizer.encode(prompt)
    want = engine.tokenizer.decode(engine.generate(ids, sampling).new_token_ids,
                                   skip_special_tokens=True)
    served = generate_http(server.urls.http, request)
    assert served.text == want
    # The same prompt with another ending: its pages hit, the groups' states are replayed.
    branch = GenerateParams(prompt[:-20] + " and a different end.", max_tokens=MAX_TOKENS,
                            min_tokens=MAX_TOKENS, top_k=1)
    chunks = list(stream_grpc(server.urls.grpc, branch))
    counts = {k: v for c in chunks for k, v in c.counts.items()}
    assert counts["cached_tokens"] >= 128
    assert counts["replayed_anchors"] > 0
