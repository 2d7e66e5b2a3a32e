from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.cache.accounting import (
    INT8_FP32_SCALE,
    KIB,
    MIB,
    layout_from_hf,
    shipped_layouts,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def layouts():
    return shipped_layouts()


def test_all_four_configs_ship(layouts):
    assert set(layouts) == {"qwen3_5_4b", "qwen3_6_27b", "qwen3_next_80b_a3b", "nemotron_h_8b"}


def test_qwen3_5_4b_matches_the_paper(layouts):
    lay = layouts["qwen3_5_4b"]
    assert lay.num_groups == 8 and lay.groups[0] == (0, 1, 2)
    assert lay.kv_bytes_per_token() == 32 * KIB  # "about 32 KiB of KV per token"
    assert 48 * MIB < lay.checkpoint_bytes() < 50 * MIB  # "a checkpoint of about 49 MiB"
    anchors = lay.anchor_bytes_per_token(1 / 16)
    assert anchors == 2560  # 8 groups x 2560 x bf16 / 16
    # Checkpoints amortized over 8192 tokens (the paper's R2): anchors cost 0.36-0.51x.
    assert 0.36 <= anchors / lay.checkpoint_bytes_per_token(8192) <= 0.51
    assert lay.anchor_bytes_per_page(64, 1 / 16) == 160 * KIB


def test_int8_anchors_halve_the_cost(layouts):
    lay = layouts["qwen3_5_4b"]
    int8 = lay.anchor_bytes_per_token(1 / 16, INT8_FP32_SCALE)
    assert int8 == pytest.approx(8 * (2560 + 4) / 16)


def test_nemotron_groups_are_mamba_runs_between_attention_layers(layouts):
    lay = layouts["nemotron_h_8b"]
    assert lay.num_linear_layers == 24 and lay.num_attention_layers == 4
    assert [len(g) for g in lay.groups] == [4, 5, 5, 5, 5]
    # Per Mamba2 layer: fp32 [128, 64, 128] state + bf16 conv over 8192 + 2*8*128 channels.
    per_layer = 128 * 64 * 128 * 4 + (8192 + 2048) * 3 * 2
    assert lay.checkpoint_bytes() == 24 * per_layer
    assert lay.kv_bytes_per_token() == 4 * 2 * 8 * 128 * 2


def test_qwen_layers_default_to_every_fourth_full_attention():
    raw = json.loads((REPO / "backend/cache/model_configs/qwen3_5_4b.json").read_text())
    text = dict(raw["text_config"])
    del text["layer_types"]
    assert layout_from_hf({"text_config": text}).groups == layout_from_hf(raw).groups


def test_bad_layouts_raise():
    raw = json.loads((REPO / "backend/cache/model_configs/nemotron_h_8b.json").read_text())
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        layout_from_hf(raw | {"hybrid_override_pattern": "M*"})
    with pytest.raises(ValueError, match="dtype"):
        layout_from_hf(raw | {"torch_dtype": "float7"})


def test_module_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "backend.cache.accounting"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for name in ("qwen3_5_4b", "qwen3_6_27b", "qwen3_next_80b_a3b", "nemotron_h_8b"):
        assert name in out
    assert "ratio@8192" in out


def test_nemotron_layer_list_reads_like_the_pattern():
    """transformers 5 saves Nemotron-H's layers as `layers_block_type`, not the pattern."""
    raw = json.loads((REPO / "backend/cache/model_configs/nemotron_h_8b.json").read_text())
    codes = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    listed = {k: v for k, v in raw.items() if k != "hybrid_override_pattern"}
    listed["layers_block_type"] = [codes[c] for c in raw["hybrid_override_pattern"]]
    assert layout_from_hf(listed).groups == layout_from_hf(raw).groups
    assert layout_from_hf(listed).checkpoint_bytes() == layout_from_hf(raw).checkpoint_bytes()
