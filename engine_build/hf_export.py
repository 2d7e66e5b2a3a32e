"""Writes a HybridForCausalLM (Qwen3.5 or Nemotron-H) as a Hugging Face-format directory
(loads in transformers too)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from backend.config import NEMOTRON_H_LETTERS, ModelConfig
from backend.model.hybrid import HybridForCausalLM
from backend.tokenizer import write_byte_tokenizer


def hf_config(cfg: ModelConfig) -> dict:
    if cfg.is_nemotron_h:
        return nemotron_h_config(cfg)
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(cfg.layer_types),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": 259,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }


def nemotron_h_config(cfg: ModelConfig) -> dict:
    """The config.json of a Nemotron-H checkpoint, as NVIDIA's are written (the layer layout
    as `hybrid_override_pattern`); transformers' NemotronHConfig reads it."""
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hybrid_override_pattern": "".join(NEMOTRON_H_LETTERS[t] for t in cfg.layer_types),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "attention_bias": cfg.attention_bias,
        "mamba_num_heads": cfg.linear_num_value_heads,
        "mamba_head_dim": cfg.linear_value_head_dim,
        "ssm_state_size": cfg.linear_key_head_dim,
        "n_groups": cfg.linear_num_key_heads,
        "conv_kernel": cfg.linear_conv_kernel_dim,
        "use_conv_bias": bool(cfg.extra.get("use_conv_bias", True)),
        "use_bias": bool(cfg.extra.get("mamba_proj_bias", False)),
        "mlp_bias": bool(cfg.extra.get("mlp_bias", False)),
        "mlp_hidden_act": cfg.hidden_act,
        "time_step_min": float(cfg.extra.get("dt_min", 0.001)),
        "chunk_size": 64,
        "layer_norm_epsilon": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": 259,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }
    low, high = cfg.extra.get("dt_limit", (0.0, float("inf")))
    if (low, high) != (0.0, float("inf")):  # (transformers' default otherwise: [0, inf))
        config["time_step_limit"] = [low, high if high < float("inf") else 1e30]
    return config


def save_hf_directory(model: HybridForCausalLM, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    generation = {"eos_token_id": cfg.eos_token_id, "pad_token_id": 259, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_byte_tokenizer(out)
    return out
