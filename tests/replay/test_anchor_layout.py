from __future__ import annotations

import pytest
import torch

from backend.model.quant import dequantize_int8, quantize_int8
from backend.replay.anchors import AnchorLayout
from backend.replay.budget import ReplayConfig, recompute_is_cheaper, replay_budget


def test_dense_tail_and_uniform_offsets():
    assert AnchorLayout(64, 4).offsets.tolist() == [60, 61, 62, 63]
    assert AnchorLayout(64, 4, "uniform").offsets.tolist() == [15, 31, 47, 63]
    assert AnchorLayout(8, 8).offsets.tolist() == list(range(8))


def test_capture_plan_maps_positions_to_block_rows():
    layout = AnchorLayout(8, 2)
    offsets, rows = layout.capture_plan(5, 19, page_blocks=[10, 11, 12])
    # positions 6, 7 (page 0 -> block 10) and 14, 15 (page 1 -> block 11); 22, 23 not reached
    assert offsets.tolist() == [1, 2, 9, 10]
    assert rows.tolist() == [20, 21, 22, 23]


def test_last_rows_are_the_last_k_in_position_order():
    layout = AnchorLayout(8, 2)
    assert layout.last_rows([10, 11, 12], 3).tolist() == [23, 24, 25]
    assert layout.last_rows([10, 11, 12], 6).tolist() == [20, 21, 22, 23, 24, 25]


@pytest.mark.parametrize("n, expected", [(64, 4), (1000, 50), (20000, 512), (1, 1)])
def test_budget_is_min_of_fraction_and_cap(n, expected):
    assert replay_budget(n, ReplayConfig(), num_available=10**6) == expected


def test_budget_never_exceeds_available_anchors():
    assert replay_budget(4096, ReplayConfig(), num_available=100) == 100
    assert replay_budget(300, ReplayConfig.exact(), num_available=300) == 300


def test_recompute_or_replay_cost_rule():
    cfg = ReplayConfig(replay_fixed_tokens=50, replay_anchor_tokens=0.5,
                       recompute_context_tokens=1000)
    # replay of 20 anchors: 60 token-units; 60 tokens at context 0 cost 60 (a tie: recompute)
    assert recompute_is_cheaper(60, 0, 20, cfg)
    assert not recompute_is_cheaper(61, 0, 20, cfg)
    # at context 1000 a recomputed token costs 2: 30 tokens tie with the replay
    assert recompute_is_cheaper(30, 1000, 20, cfg) and not recompute_is_cheaper(31, 1000, 20, cfg)
    # a free replay is only ever matched by a live state at the match end itself
    free = ReplayConfig(replay_fixed_tokens=0, replay_anchor_tokens=0)
    assert recompute_is_cheaper(0, 500, 8, free) and not recompute_is_cheaper(1, 500, 8, free)
    with pytest.raises(ValueError, match="replay_fixed_tokens"):
        ReplayConfig(replay_fixed_tokens=-1)
    with pytest.raises(ValueError, match="recompute_context_tokens"):
        ReplayConfig(recompute_context_tokens=0)


def test_int8_round_trip_error_is_within_half_a_step():
    rows = torch.randn(5, 64) * torch.tensor([0.01, 1, 10, 100, 1000]).unsqueeze(1)
    q, scale = quantize_int8(rows)
    assert q.dtype == torch.int8
    err = (dequantize_int8(q, scale) - rows).abs()
    assert (err <= scale.unsqueeze(1) / 2 + 1e-6).all()
