"""engine_build/build.py: checkpoint validation, the repository it writes, each backend."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO, read_parameters
from engine_build import build

MODELS = ("ensemble", "preprocessing", "hybrid_llm", "postprocessing", "hybrid_llm_bls")


def _model_copy(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(MODEL_REPO / DEFAULT_MODEL, dst)
    return dst


def test_eager_build_writes_a_complete_repository(tmp_path, capsys):
    ckpt = _model_copy(tmp_path)
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo")]) == 0
    for name in MODELS:
        assert (tmp_path / "repo" / name / "config.pbtxt").is_file()
    for name in ("preprocessing", "hybrid_llm", "postprocessing", "hybrid_llm_bls"):
        assert (tmp_path / "repo" / name / "1" / "model.py").is_file()
    params = read_parameters(tmp_path / "repo" / "hybrid_llm" / "config.pbtxt")
    assert params["model_path"] == str(ckpt.resolve()) and params["executor"] == "torch"
    for name in ("preprocessing", "postprocessing", "hybrid_llm_bls"):
        tokenizer = read_parameters(tmp_path / "repo" / name / "config.pbtxt")["tokenizer_dir"]
        assert tokenizer == str(ckpt.resolve())
    assert "checkpoint ok" in capsys.readouterr().out
    # a second build into the same place needs --force, and is refused before any step
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo")]) == 1
    out, err = capsys.readouterr()
    assert "--force" in err and "checkpoint ok" not in out
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo"), "--force"]) == 0


def test_aot_build_selects_the_compiled_executor(aot_build):
    model_dir, engine_dir, repo = aot_build
    meta = json.loads((engine_dir / "engine.json").read_text())
    assert meta["backend"] == "aot" and meta["device"] == "cpu"
    assert sorted(meta["packages"]) == ["decode", "prefill", "replay_0", "replay_1"]
    params = read_parameters(repo / "hybrid_llm" / "config.pbtxt")
    assert params["executor"] == "compiled" and params["engine_dir"] == "aot"


def test_broken_checkpoints_are_refused(tmp_path, capsys):
    ckpt = _model_copy(tmp_path)
    (ckpt / "tokenizer.json").unlink()
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "r1")]) == 1
    assert "tokenizer.json" in capsys.readouterr().err
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "r2")]) == 1
    assert "shape" in capsys.readouterr().err
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_tensorrt_backend_says_tensorrt_is_missing(tmp_path, capsys):
    pytest.importorskip("triton")
    from plugins.tensorrt import tensorrt_available

    if tensorrt_available()[0]:
        pytest.skip("TensorRT is installed here")
    code = build.main(["--model", str(_model_copy(tmp_path)), "--repo", str(tmp_path / "r"),
                       "--backend", "tensorrt"])
    assert code == build.TENSORRT_MISSING
    assert "TensorRT" in capsys.readouterr().err


def test_tensorrt_plugin_ptx_is_generated_without_a_gpu():
    pytest.importorskip("triton")
    from plugins.tensorrt import compile_ptx

    for op in ("gated_delta_scan", "ssd_scan", "causal_conv1d", "anchor_capture"):
        kernel = compile_ptx(op, "bfloat16", arch=90, heads=4, k_dim=64, v_dim=64)
        assert f".entry {kernel.name}(" in kernel.ptx and ".target sm_90" in kernel.ptx
    with pytest.raises(ValueError, match="unknown operator"):
        compile_ptx("nope")


def test_lora_adapters_are_checked_and_served(tmp_path, capsys):
    """--lora NAME=PATH: the adapter is read against the checkpoint and named in
    lora_adapters (absolute path); one that does not fit the checkpoint, a malformed value
    or a compiled backend is refused before anything is written."""
    import torch
    from hf_oracle import make_lora_adapter
    from transformers import Qwen3_5ForCausalLM

    ckpt = _model_copy(tmp_path)
    hf = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    adapter = make_lora_adapter(tmp_path / "tutor", hf, ("q_proj", "down_proj"))
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo"),
                       "--lora", f"tutor={adapter}"]) == 0
    params = read_parameters(tmp_path / "repo" / "hybrid_llm" / "config.pbtxt")
    assert params["lora_adapters"] == f"tutor={adapter.resolve()}"
    assert "LoRA adapters tutor ok" in capsys.readouterr().out
    head = make_lora_adapter(tmp_path / "head", hf, ("lm_head",))
    for extra, message in ((["--lora", f"head={head}"], "lm_head"),
                           (["--lora", "tutor"], "not NAME=PATH"),
                           (["--lora", f"tutor={adapter}", "--backend", "aot"],
                            "--backend eager")):
        assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "bad"),
                           *extra]) == 1
        assert message in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], "--device applies to --backend aot only"),
    (["--backend", "aot", "--device", "gpu0"], "--device must be cpu, cuda or cuda:N"),
])
def test_device_mistakes_are_one_line_errors(tmp_path, capsys, args, message):
    ckpt = _model_copy(tmp_path)
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo"), *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "repo").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_aot_for_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    ckpt = _model_copy(tmp_path)
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo"), "--backend",
                       "aot", "--device", "cuda"]) == 1
    assert "CUDA is not available here" in capsys.readouterr().err
