"""Nemotron-H (Mamba2 + attention + MLP layers): parity with transformers'
NemotronHForCausalLM on the same safetensors, and exact group replay."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import NEMOTRON_H_CONFIGS, make_nemotron_h_checkpoint
from test_oracle import assert_close

from backend.config import ModelConfig
from backend.model import load_model
from backend.model.generate import PagedSession, greedy_generate

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(NEMOTRON_H_CONFIGS), ids=list(NEMOTRON_H_CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_nemotron_h_checkpoint(path, seed=len(request.param),
                                    **dict(NEMOTRON_H_CONFIGS[request.param]))
    ours = load_model(path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (1, 300), generator=gen)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    return hf, ours, ids, ref


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
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelConfig.from_hf_dict({**raw, "hybrid_override_pattern": "-M-E*-M-M*-"})


def test_prefill_logits_match(pair):
    _, ours, ids, ref = pair
    assert_close(ours.logits(ids)[0], ref)


def test_decode_steps_carry_state_and_pages(pair):
    _, ours, ids, ref = pair
    session = PagedSession(ours, batch_size=1, max_tokens=300, page_size=64)
    assert_close(session.step([ids[0, :200].tolist()])[0], ref[199])
    for t in range(200, 240):
        assert_close(session.step([[int(ids[0, t])]])[0], ref[t])


def test_uneven_chunks_and_ragged_rows_match_full_prefill(pair):
    _, ours, ids, ref = pair
    session = PagedSession(ours, batch_size=3, max_tokens=300, page_size=16)
    session.step([ids[0, :100].tolist(), ids[0, :7].tolist(), ids[0, :64].tolist()])
    out = session.step([ids[0, 100:101].tolist(), ids[0, 7:101].tolist(),
                        ids[0, 64:101].tolist()])
    for row in out:
        assert_close(row, ref[100])


def test_greedy_generation_matches_transformers(pair):
    hf, ours, _, _ = pair
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 70, 130)]
    produced = greedy_generate(ours, prompts, max_new_tokens=16, page_size=32)
    for prompt, tokens in zip(prompts, produced):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert tokens == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("j", [1, 5, 64, 130])
def test_replay_over_all_positions_is_exact(pair, j):
    """Replaying every position of a group from its entry hidden states (MLP-only layers
    included) rebuilds the states a prefill leaves."""
    _, ours, ids, _ = pair
    cfg = ours.config
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
