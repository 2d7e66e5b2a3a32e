from __future__ import annotations

import pytest
import torch

from backend.model.conv import causal_conv1d
from backend.model.delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_step,
    recurrent_gated_delta_rule,
)
from backend.model.gated_deltanet import l2norm

SHAPES = [  # B, T, H, K, V, chunk
    (1, 1, 1, 8, 8, 64),
    (2, 70, 3, 16, 8, 64),
    (1, 129, 2, 8, 24, 32),
    (3, 33, 4, 32, 32, 16),
    (2, 5, 2, 16, 8, 64),  # one short chunk: computed as an 8-token chunk
    (2, 20, 2, 8, 8, 64),  # ... as a 32-token chunk
]


def _inputs(B, T, H, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=g))
    k = l2norm(torch.randn(B, T, H, K, generator=g))
    v = torch.randn(B, T, H, V, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 2
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g)
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}c{}".format(*s))
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
def test_chunked_equals_recurrent(shape, with_state):
    B, T, H, K, V, C = shape
    q, k, v, g, beta, s0 = _inputs(B, T, H, K, V)
    init = s0 if with_state else None
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, init, chunk_size=C)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}V{}c{}".format(*s))
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
def test_state_only_chunked_equals_recurrent(shape, with_state):
    """output=False (suffix replay's last layer of a group): the same final state, no output."""
    B, T, H, K, V, C = shape
    q, k, v, g, beta, s0 = _inputs(B, T, H, K, V, seed=5)
    init = s0 if with_state else None
    _, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, init, chunk_size=C, output=False)
    assert o is None
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


def test_padding_with_zero_decay_and_beta_keeps_final_state():
    q, k, v, g, beta, s0 = _inputs(1, 50, 2, 8, 8)
    _, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    pad = lambda x: torch.cat((x, torch.randn(1, 14, *x.shape[2:])), dim=1)  # noqa: E731
    g_pad = torch.cat((g, torch.zeros(1, 14, 2)), dim=1)
    b_pad = torch.cat((beta, torch.zeros(1, 14, 2)), dim=1)
    _, s = chunk_gated_delta_rule(pad(q), pad(k), pad(v), g_pad, b_pad, s0)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


def test_conv_state_carries_across_splits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 20, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    y_full, s_full = causal_conv1d(x, w)
    y1, s1 = causal_conv1d(x[:, :7], w)
    y2, s2 = causal_conv1d(x[:, 7:8], w, s1)
    y3, s3 = causal_conv1d(x[:, 8:], w, s2)
    torch.testing.assert_close(torch.cat((y1, y2, y3), dim=1), y_full)
    torch.testing.assert_close(s3, s_full)


def test_conv_state_of_ragged_rows_is_taken_at_each_length():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 10, 3, generator=g)
    w = torch.randn(3, 4, generator=g)
    _, s = causal_conv1d(x, w, lengths=torch.tensor([10, 5]))
    _, s_short = causal_conv1d(x[1:, :5], w)
    torch.testing.assert_close(s[1:], s_short)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
def test_decode_step_equals_recurrent(with_state):
    q, k, v, g, beta, s0 = _inputs(3, 1, 4, 16, 8, seed=2)
    init = s0 if with_state else None
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    o, s = gated_delta_step(q, k, v, g, beta, init)
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=1e-5)
