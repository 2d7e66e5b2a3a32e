"""The causal depthwise conv1d (channels-last multiply-adds) against F.conv1d."""

import pytest
import torch
import torch.nn.functional as F

from backend.model.conv import causal_conv1d


def _reference(x, weight, state, lengths, silu):
    """Plain PyTorch: F.conv1d over [state : x] in channels-first layout."""
    B, T, C = x.shape
    W = weight.shape[-1]
    head = torch.zeros(B, C, W - 1) if state is None else state
    full = torch.cat((head, x.transpose(1, 2)), dim=-1)
    y = F.conv1d(full, weight.unsqueeze(1), groups=C).transpose(1, 2)
    ends = [T] * B if lengths is None else lengths.tolist()
    new_state = torch.stack([full[b, :, n:n + W - 1] for b, n in enumerate(ends)])
    return (F.silu(y) if silu else y), new_state


@pytest.mark.parametrize("B,T,C,W", [(1, 1, 8, 4), (2, 1, 6, 4), (1, 16, 512, 4),
                                     (3, 37, 24, 4), (2, 70, 16, 3), (1, 5, 4, 2)])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
def test_conv_equals_conv1d(B, T, C, W, with_state, silu):
    g = torch.Generator().manual_seed(B * 1000 + T)
    x = torch.randn(B, T, C, generator=g)
    w = torch.randn(C, W, generator=g)
    state = torch.randn(B, C, W - 1, generator=g) if with_state else None
    y, s = causal_conv1d(x, w, state, silu=silu)
    y_ref, s_ref = _reference(x, w, state, None, silu)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert s.shape == (B, C, W - 1)


def test_conv_ragged_lengths_equal_conv1d():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 12, 10, generator=g)
    w = torch.randn(10, 4, generator=g)
    state = torch.randn(3, 10, 3, generator=g)
    lengths = torch.tensor([12, 1, 7])
    y, s = causal_conv1d(x, w, state, lengths)
    y_ref, s_ref = _reference(x, w, state, lengths, True)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)


def test_conv_keeps_the_input_dtype():
    x = torch.randn(1, 9, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 4)
    y, s = causal_conv1d(x, w, torch.zeros(1, 8, 3))
    assert y.dtype == s.dtype == torch.bfloat16
    y_ref, _ = _reference(x.float(), w.bfloat16().float(), None, None, True)
    torch.testing.assert_close(y.float(), y_ref, atol=3e-2, rtol=3e-2)
