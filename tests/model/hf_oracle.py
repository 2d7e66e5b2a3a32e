"""Builders for tests that compare the model against transformers' Qwen3_5ForCausalLM."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_CONFIGS = {
    # id: overrides of the base config below
    "base-g3": {},
    "g1-tied-rope50": {
        "layer_types": ["linear_attention", "full_attention"] * 3,
        "num_hidden_layers": 6,
        "tie_word_embeddings": True,
        "partial_rotary_factor": 0.5,
    },
    "heads-dk-ne-dv": {
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 24,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 12,
        "linear_value_head_dim": 20,
        "partial_rotary_factor": 1.0,
    },
}


def hf_config_dict(**overrides) -> dict:
    cfg = {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }
    prf = overrides.pop("partial_rotary_factor", None)
    cfg.update(overrides)
    if prf is not None:
        cfg["rope_parameters"]["partial_rotary_factor"] = prf
    return cfg


def make_hf_checkpoint(path: Path, seed: int = 0, slow_decay: bool = False,
                       family: str = "qwen3_5", **overrides):
    """Saves a randomly initialised HF Qwen3.5 model (with non-trivial norms) to `path`;
    family "qwen3_next": transformers' Qwen3-Next of the same shapes (its packed projections;
    sparse MLPs where the overrides give experts), routers perturbed off their zero init.

    slow_decay: linear layers forget slowly (small A, negative dt bias), so truncating the
    history (suffix replay) visibly changes their states.
    """
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    torch.manual_seed(seed)
    raw = hf_config_dict(**overrides)
    raw.pop("model_type")
    raw.pop("architectures")
    if family == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**raw)).eval()
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**raw)).eval()
    with torch.no_grad():
        # Default init leaves norms at identity and A_log / dt_bias constant: perturb them
        # so that every parameter's role is visible in the logits.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "dt_bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            if "conv1d" in name or "embed_tokens" in name:
                p.mul_(4.0)
            if slow_decay and "A_log" in name:
                p.fill_(-3.0)
            if slow_decay and "dt_bias" in name:
                p.fill_(-2.0)
            if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


QWEN3_NEXT_CONFIGS = {
    # id: overrides of hf_config_dict's base, for transformers' Qwen3NextForCausalLM
    "dense": {"num_experts": 0},
    # sparse MLPs on every layer but one (mlp_only_layers), 8 experts, 2 a token
    "moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1,
            "mlp_only_layers": [3]},
}


NEMOTRON_H_CONFIGS = {
    # id: overrides of nemotron_h_config_dict's base
    "mlp-edges-g2": {},
    "m-only-groups-g1": {
        "layers_block_type": ["linear_attention", "linear_attention", "full_attention",
                              "linear_attention", "mlp", "linear_attention", "full_attention"],
        "n_groups": 1,
        "use_conv_bias": False,
    },
    # mixture-of-experts layers inside the groups and at the end, through a latent projection
    # (Nemotron 3's layout): 8 experts in 2 groups, 2 chosen from the better group
    "moe-latent": {
        "layers_block_type": ["linear_attention", "moe", "linear_attention", "full_attention",
                              "moe", "linear_attention", "mlp", "linear_attention", "moe"],
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
        "moe_latent_size": 32, "routed_scaling_factor": 2.5,
    },
}


def nemotron_h_config_dict(**overrides) -> dict:
    cfg = {
        "vocab_size": 97,
        "hidden_size": 64,
        "layers_block_type": ["mlp", "linear_attention", "mlp", "linear_attention",
                              "full_attention", "mlp", "linear_attention", "mlp",
                              "linear_attention", "full_attention", "mlp"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 64,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": None,  # generation runs to max_tokens, as with the Qwen3.5 builder
    }
    cfg.update(overrides)
    return cfg


def make_nemotron_h_checkpoint(path: Path, seed: int = 0, slow_decay: bool = False,
                               **overrides):
    """Saves a randomly initialised transformers NemotronHForCausalLM to `path` (norms,
    decays, dt biases and skips perturbed so each parameter shows in the logits), with the
    project's byte tokenizer beside it."""
    import shutil

    from transformers import NemotronHConfig, NemotronHForCausalLM

    from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**nemotron_h_config_dict(**overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(-2.0 if slow_decay else 0.5 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.full_like(p, -3.0) if slow_decay
                        else torch.empty_like(p).uniform_(0.0, 2.5))
            elif name.endswith(".D"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("conv1d.bias"):  # initialised to zeros
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in name or "embeddings" in name:
                p.mul_(4.0)
            elif "mixer.out_proj" in name or name == "lm_head.weight":
                p.mul_(4.0)  # logits of order 1, in which the mixers' states weigh
            elif name.endswith("gate.weight"):  # the router starts at zero: all ties
                p.normal_(0.0, 0.5)
            elif ".experts." in name:
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (MODEL_REPO / DEFAULT_MODEL / f).exists():
            shutil.copy2(MODEL_REPO / DEFAULT_MODEL / f, path / f)
    return model


def make_lora_adapter(path: Path, hf_model, targets: tuple[str, ...], rank: int = 8,
                      alpha: float = 16.0, seed: int = 0, std: float = 0.05,
                      rslora: bool = False) -> Path:
    """A random LoRA adapter in PEFT's saved layout (`backend.model.lora.save_adapter`) for
    the transformers model `hf_model`: lora_A [r, in] / lora_B [out, r] for every nn.Linear
    whose name ends in one of `targets`."""
    from backend.model.lora import save_adapter

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            weights[name] = (torch.randn(rank, module.in_features, generator=g) * std,
                             torch.randn(module.out_features, rank, generator=g) * std)
    return save_adapter(path, weights, alpha, rslora)


def merge_lora(hf_model, adapter_dir: Path):
    """`hf_model` with the adapter's low-rank updates added to its weights (W + s B A, s =
    lora_alpha / r, or / sqrt(r) with use_rslora), in place: the oracle of a served adapter."""
    import json
    import math

    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace("lora_A", "lora_B")]
            module = hf_model.get_submodule(name)
            module.weight += scale * (b @ a).to(module.weight.dtype)
    return hf_model
