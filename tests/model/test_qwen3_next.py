"""Qwen3-Next at full size, on the meta device (no weights): the shipped Qwen3-Next-80B-A3B
config gives its layout and exactly transformers' number of parameters (parity of logits,
decode and generation on small checkpoints: tests/model/test_oracle.py)."""

from __future__ import annotations

import json

import pytest
import torch

from backend.cache.accounting import CONFIG_DIR
from backend.config import ModelConfig
from backend.model.hybrid import HybridForCausalLM
from backend.model.mlp import SparseMoE, SwiGLU

pytest.importorskip("transformers")


def test_qwen3_next_80b_layout_and_parameter_count():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    raw = json.loads((CONFIG_DIR / "qwen3_next_80b_a3b.json").read_text())
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.num_groups == 12 and cfg.groups[0] == (0, 1, 2)
    assert cfg.has_moe and cfg.extra["moe"]["layers"] == tuple(range(48))
    with torch.device("meta"):
        ours = HybridForCausalLM(cfg)
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**{k: v for k, v in raw.items()
                                                     if not k.startswith("_")}))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters())
    assert 79e9 < count < 82e9  # "80B"
    assert all(isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers)
    # mlp_only_layers / decoder_sparse_step put dense SwiGLU MLPs where they say
    sparse = ModelConfig.from_hf_dict({**raw, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert sparse.extra["moe"]["layers"] == tuple(i for i in range(1, 48, 2) if i != 3)
    with torch.device("meta"):
        mixed = HybridForCausalLM(sparse)
    assert isinstance(mixed.model.layers[0].mlp, SwiGLU)
    assert isinstance(mixed.model.layers[3].mlp, SwiGLU)
    assert isinstance(mixed.model.layers[5].mlp, SparseMoE)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**raw, "num_experts_per_tok": 513})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelConfig.from_hf_dict({**raw, "decoder_sparse_step": 0})


def test_omitted_moe_fields_take_transformers_defaults():
    """A Qwen3-Next config without its MoE fields is what transformers builds from it (512
    experts of 512, top 10, a shared expert of 512), not a dense model; num_experts 0 is
    dense."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    raw = json.loads((CONFIG_DIR / "qwen3_next_80b_a3b.json").read_text())
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "decoder_sparse_step", "norm_topk_prob")
    small = {k: v for k, v in raw.items() if not k.startswith("_") and k not in moe_keys}
    small.update(num_hidden_layers=4, hidden_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, intermediate_size=96,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, vocab_size=97)
    small.pop("layer_types", None)  # 48 layers' worth: the default interval instead
    cfg = ModelConfig.from_hf_dict(small)
    moe = cfg.extra["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["intermediate_size"],
            moe["shared_intermediate_size"]) == (512, 10, 512, 512)
    with torch.device("meta"):
        ours = HybridForCausalLM(cfg)
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**small))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert not ModelConfig.from_hf_dict({**small, "num_experts": 0}).has_moe
