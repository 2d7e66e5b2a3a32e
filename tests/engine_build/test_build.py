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


def test_a_repository_where_nothing_can_be_written_is_refused_before_the_steps(capsys):
    """/proc takes no new folder, for root too: the checkpoint was validated, then the
    repository's mkdir raised a traceback (FileNotFoundError / PermissionError)."""
    rc = build.main(["--model", str(MODEL_REPO / DEFAULT_MODEL), "--repo",
                     "/proc/hybrid_llm_build_probe/repo"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot write in /proc" in err and "Traceback" not in err


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
    from safetensors.torch import load_file, save_file
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
    nan = make_lora_adapter(tmp_path / "nan", hf, ("q_proj",))
    weights = load_file(nan / "adapter_model.safetensors")
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, nan / "adapter_model.safetensors")
    comma = shutil.copytree(adapter, tmp_path / "a,b")  # lora_adapters is comma-separated
    for extra, message in ((["--lora", f"head={head}"], "lm_head"),
                           (["--lora", f"nan={nan}"], "not finite floating-point numbers"),
                           (["--lora", f"comma={comma}"], "comma"),
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


def _edit_config(ckpt, **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize("case, message", [
    ("rope_yarn", "only the default rotary embedding"),
    ("rope_scaling_legacy", "only the default rotary embedding"),
    ("kv_heads_zero", "num_key_value_heads must be >= 1"),
    ("interval_zero", "cannot be used"),
    ("vocab_null", "cannot be used"),
    ("hidden_negative", "hidden_size must be >= 1"),
    ("heads_fraction", "num_attention_heads must be a whole number, got 4.7"),
    ("config_a_list", "not a JSON object"),
    ("eos_out_of_range", "eos_token_id 100000 is outside the vocabulary"),
    ("int_embedding", "not floating point"),
    ("tokenizer_corrupt", "its tokenizer does not load"),
    ("tokenizer_larger", "more than the model's vocabulary"),
])
def test_checkpoints_that_would_serve_wrongly_or_crash_are_one_line_errors(
        tmp_path, capsys, case, message):
    """What an audit of the builder found: a scaled rotary embedding, integer weights, an
    end id or tokenizer past the vocabulary built (and served other logits, or failed at
    serve time); config values that divide by zero or are of the wrong type gave
    tracebacks. Each is now a one-line error before anything is written."""
    from safetensors.torch import load_file, save_file

    ckpt = _model_copy(tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if case == "rope_yarn":
        _edit_config(ckpt, rope_parameters={**(text.get("rope_parameters") or {}),
                                            "rope_type": "yarn", "factor": 4.0})
    elif case == "rope_scaling_legacy":
        _edit_config(ckpt, rope_scaling={"type": "linear", "factor": 2.0})
    elif case == "kv_heads_zero":
        _edit_config(ckpt, num_key_value_heads=0)
    elif case == "interval_zero":
        text.pop("layer_types", None)
        _edit_config(ckpt, **{k: v for k, v in text.items() if k != "layer_types"},
                     full_attention_interval=0)
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg.pop("layer_types", None)
        (ckpt / "config.json").write_text(json.dumps(cfg))
    elif case == "vocab_null":
        _edit_config(ckpt, vocab_size=None)
    elif case == "hidden_negative":
        _edit_config(ckpt, hidden_size=-8)
    elif case == "heads_fraction":  # (int() made it 4: served as another model)
        _edit_config(ckpt, num_attention_heads=4.7)
    elif case == "config_a_list":
        (ckpt / "config.json").write_text("[]")
    elif case == "eos_out_of_range":
        _edit_config(ckpt, eos_token_id=100000)
    elif case == "int_embedding":
        [weights] = list(ckpt.glob("*.safetensors"))
        tensors = load_file(weights)
        key = next(k for k in tensors if k.endswith("embed_tokens.weight"))
        tensors[key] = (tensors[key] * 100).to(torch.int32)
        save_file(tensors, weights)
    elif case == "tokenizer_corrupt":
        (ckpt / "tokenizer.json").write_text("{not json")
    elif case == "tokenizer_larger":
        _edit_config(ckpt, vocab_size=200, eos_token_id=5)
        [weights] = list(ckpt.glob("*.safetensors"))
        tensors = load_file(weights)
        for k in list(tensors):
            if k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight"):
                tensors[k] = tensors[k][:200].contiguous()
        save_file(tensors, weights)
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "repo").exists()


def test_a_repository_and_checkpoint_that_overlap_are_refused(tmp_path, capsys):
    """The shipped layout keeps the checkpoint inside the repository: --force used to delete
    it (rc 0) while replacing the models' folders."""
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPO / DEFAULT_MODEL, repo / "hybrid_llm" / "1" / "tiny")
    ckpt = repo / "hybrid_llm" / "1" / "tiny"
    for model, where in ((ckpt, repo), (tmp_path / "c", tmp_path / "c" / "repo")):
        if not model.exists():
            shutil.copytree(MODEL_REPO / DEFAULT_MODEL, model)
        assert build.main(["--model", str(model), "--repo", str(where), "--force"]) == 1
        assert "overlap" in capsys.readouterr().err
    assert (ckpt / "config.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--backend", "aot", "--engine-dir", ""], "--engine-dir must be a folder inside"),
    (["--backend", "aot", "--engine-dir", "/tmp/elsewhere"], "--engine-dir must be a folder"),
    (["--backend", "aot", "--engine-dir", "../up"], "--engine-dir must be a folder inside"),
])
def test_engine_dir_outside_the_checkpoint_is_refused(tmp_path, capsys, args, message):
    ckpt = _model_copy(tmp_path)
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo"), *args]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_paths_config_pbtxt_cannot_carry_are_refused(tmp_path, capsys):
    odd = tmp_path / 'we"ird'
    odd.mkdir()
    ckpt = _model_copy(odd)
    assert build.main(["--model", str(ckpt), "--repo", str(tmp_path / "repo")]) == 1
    assert "holds a quote" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert build.main(["--model", str(_model_copy(tmp_path)), "--repo",
                       str(afile / "sub")]) == 1
    assert "is a file, not a folder" in capsys.readouterr().err
