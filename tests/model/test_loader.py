"""Loader: real HF layouts load; broken checkpoints fail with errors naming file and tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_oracle import make_hf_checkpoint
from safetensors.torch import load_file, save_file

from backend.model import CheckpointError, load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_hf_checkpoint(path, seed=2)
    return path


@pytest.fixture
def broken(checkpoint, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(checkpoint, dst)
    return dst


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_bf16_load_keeps_shapes_and_dtype(checkpoint):
    model = load_model(checkpoint, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ids = torch.arange(20).unsqueeze(0)
    ref = load_model(checkpoint).logits(ids)
    assert (model.logits(ids).float() - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


def test_sharded_and_multimodal_layout_loads(checkpoint, tmp_path):
    tensors = load_file(checkpoint / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)  # ignored, as in real checkpoints
    names = sorted(renamed)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    text = json.loads((checkpoint / "config.json").read_text())
    text["model_type"] = "qwen3_5_text"
    wrapper = {"model_type": "qwen3_5", "text_config": text,
               "tie_word_embeddings": text["tie_word_embeddings"]}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    ids = torch.arange(30).unsqueeze(0)
    torch.testing.assert_close(load_model(tmp_path).logits(ids), load_model(checkpoint).logits(ids))


def test_missing_tensor_is_named(broken):
    _rewrite(broken, lambda t: t.pop("model.layers.0.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers\.0\.linear_attn\.A_log"):
        load_model(broken)


def test_unexpected_tensor_is_named(broken):
    _rewrite(broken, lambda t: t.update({"model.layers.0.surprise": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*unexpected.*surprise"):
        load_model(broken)


def test_shape_mismatch_names_file_and_tensor(broken):
    _rewrite(broken, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.norm\.weight.*\(3,\)"):
        load_model(broken)


def test_unsupported_model_type(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'"):
        load_model(broken)


def test_unreadable_weights_file(broken):
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable"):
        load_model(broken)


def test_missing_files(broken, tmp_path):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(broken)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nowhere")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(broken)


@pytest.mark.parametrize("field, value, message", [
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false"),
    ("attention_bias", "no", "'attention_bias' must be true or false"),
    ("eos_token_id", "256", "eos_token_id must be a token id"),
    ("eos_token_id", 256.5, "eos_token_id must be a token id"),
    ("rope_theta", 0, "rope_theta must be a finite number > 0"),
    ("rope_theta", -5, "rope_theta must be a finite number > 0"),
])
def test_odd_config_values_are_refused(broken, field, value, message):
    """A string "false" read as true (bool("false")), a string end id (a TypeError at build),
    a rotary base of 0 or below (garbage positions) loaded or crashed."""
    config = json.loads((broken / "config.json").read_text())
    target = config.get("text_config", config)
    if field == "rope_theta" and "rope_parameters" in target:
        target["rope_parameters"]["rope_theta"] = value
    else:
        target[field] = value
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model(broken)


@pytest.mark.parametrize("index", [[], {"weight_map": []}, {"weight_map": None},
                                   {"weight_map": {"x": 5}}])
def test_a_malformed_shard_index_is_a_clear_error(broken, index):
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_model(broken)


def test_nemotron_h_time_step_limit_forms():
    """transformers writes an unbounded limit {"__float__": "Infinity"}; a bad one is refused."""
    from hf_oracle import nemotron_h_config_dict

    from backend.config import ModelConfig

    raw = {"model_type": "nemotron_h", **nemotron_h_config_dict()}
    for given, want in (([0.0, {"__float__": "Infinity"}], (0.0, float("inf"))),
                        ([0.001, 0.1], (0.001, 0.1)), (None, (0.0, float("inf")))):
        cfg = ModelConfig.from_hf_dict({**raw, "time_step_limit": given})
        assert cfg.extra["dt_limit"] == want
    for bad in ([0.1, 0.01], [-1, 2], "x", [1]):
        with pytest.raises(ValueError, match="time_step_limit"):
            ModelConfig.from_hf_dict({**raw, "time_step_limit": bad})
