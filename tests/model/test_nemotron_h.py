"""Nemotron-H (Mamba2 + attention + MLP / MoE layers): configuration, groups and exact group replay
(parity of logits, decode and generation with transformers: tests/model/test_oracle.py)."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import NEMOTRON_H_CONFIGS, make_nemotron_h_checkpoint

from backend.config import ModelConfig
from backend.model import load_model
from backend.model.generate import PagedSession

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(NEMOTRON_H_CONFIGS), ids=list(NEMOTRON_H_CONFIGS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_nemotron_h_checkpoint(path, seed=len(request.param),
                               **dict(NEMOTRON_H_CONFIGS[request.param]))
    return load_model(path)


def test_config_groups_span_mamba_runs_between_attention():
    from hf_oracle import nemotron_h_config_dict

    cfg = ModelConfig.from_hf_dict({"model_type": "nemotron_h", **nemotron_h_config_dict()})
    # M at 1, 3, 6, 8; * at 4, 9; - elsewhere: MLP-only layers inside a run belong to it.
    assert cfg.groups == ((1, 2, 3), (6, 7, 8))
    assert cfg.group_state_layers == ((1, 3), (6, 8))
    assert cfg.group_entry_layers == (1, 6)
    assert cfg.conv_dim == 8 * 8 + 2 * 2 * 16 and cfg.rotary_dim == 0
    # The checkpoints' pattern string gives the same layout.
    raw = {"model_type": "nemotron_h", **nemotron_h_config_dict()}
    raw["hybrid_override_pattern"] = "-M-M*-M-M*-"
    del raw["layers_block_type"]
    assert ModelConfig.from_hf_dict(raw).layer_types == cfg.layer_types
    # E: a mixture-of-experts layer, inside its run's group like an MLP layer
    moe = {**raw, "hybrid_override_pattern": "-MEM*-M-M*E", "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 2, "topk_group": 1}
    cfg = ModelConfig.from_hf_dict(moe)
    assert cfg.groups == ((1, 2, 3), (6, 7, 8)) and cfg.layer_types[2] == "moe"
    assert cfg.extra["moe"]["num_experts"] == 8 and cfg.extra["moe"]["latent_size"] is None
    with pytest.raises(ValueError, match="groups must divide"):
        ModelConfig.from_hf_dict({**moe, "n_group": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**moe, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="one shared expert"):
        ModelConfig.from_hf_dict({**moe, "n_shared_experts": 2})


@pytest.mark.parametrize("j", [1, 5, 64, 130])
def test_replay_over_all_positions_is_exact(model, j):
    """Replaying every position of a group from its entry hidden states (MLP-only layers
    included) rebuilds the states a prefill leaves."""
    ours, cfg = model, model.config
    ids = torch.randint(0, cfg.vocab_size, (1, j), generator=torch.Generator().manual_seed(1))
    session = PagedSession(ours, batch_size=1, max_tokens=j, page_size=16)
    session.step([ids[0, :j].tolist()])
    states = session.states.read(0)
    hidden = ours.capture_hidden(ids[:, :j], torch.arange(j).unsqueeze(0))
    for g, layers in enumerate(cfg.group_state_layers):
        replayed = ours.replay_group(g, hidden[g])
        assert len(replayed) == len(layers)
        for layer_id, (conv, rec) in zip(layers, replayed):
            want_conv, want_rec = states[cfg.linear_layer_ids.index(layer_id)]
            torch.testing.assert_close(conv[0], want_conv, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(rec[0], want_rec, atol=1e-5, rtol=1e-4)


def test_real_8b_config_gives_transformers_names_and_shapes():
    """Nemotron-H-8B's config.json (shipped, no weights): our model has the parameters,
    names and shapes transformers builds for it, so its checkpoint loads unchanged (its
    `backbone.` prefix is mapped to `model.` by the loader)."""
    import json
    from pathlib import Path

    from transformers import NemotronHConfig, NemotronHForCausalLM

    from backend.model import HybridForCausalLM

    raw = json.loads((Path(__file__).resolve().parents[2]
                      / "backend/cache/model_configs/nemotron_h_8b.json").read_text())
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.num_hidden_layers == 52 and len(cfg.linear_layer_ids) == 24
    assert len(cfg.attention_layer_ids) == 4 and cfg.num_groups == 5
    hf_raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    hf_raw["head_dim"] = hf_raw.pop("attention_head_dim")
    with torch.device("meta"):
        ours = HybridForCausalLM(cfg)
        hf = NemotronHForCausalLM(NemotronHConfig(**hf_raw))
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in hf.named_parameters()}
