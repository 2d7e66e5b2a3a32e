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
