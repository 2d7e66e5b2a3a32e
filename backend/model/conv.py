"""Causal depthwise conv1d with a carried state (the last `kernel - 1` inputs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    silu: bool = True,
    at: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
):
    """x: [B, T, C]; weight: [C, W]; state: [B, C, W - 1] or None (zeros); bias: [C] or None.

    Returns silu(conv(x) + bias) (without silu when silu=False) [B, T, C] and the new state
    [B, C, W - 1]: the last W - 1 inputs
    before each sequence's end (`lengths` [B] for right-padded batches, else T).
    With `at` = (rows [M], offsets [M]) a third result: the state [M, C, W - 1] after the
    first `offset` tokens of each `row` (a mid-forward snapshot).

    Computed channels-last as W shifted multiply-adds over [B, T, C] (in place after the
    first): the kernel is tiny (W = 4), so this streams the input a few times where a
    depthwise convolution call would transpose it twice and cost more at every size measured
    (`tests/model/test_conv.py` holds it to F.conv1d).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    head = x.new_zeros(B, W - 1, C) if state is None else state.transpose(1, 2).to(x.dtype)
    full = torch.cat((head, x), dim=1)  # [B, W - 1 + T, C]
    taps = weight.t().to(x.dtype)  # [W, C]
    if T == 1:
        y = (full * taps).sum(1, keepdim=True)
    else:
        y = torch.mul(full[:, :T], taps[0])
        for i in range(1, W):
            y.addcmul_(full[:, i:i + T], taps[i])
    if bias is not None:
        y = y + bias.to(x.dtype)
    if lengths is None:
        new_state = full[:, T:]
    else:
        idx = lengths.view(B, 1, 1) + torch.arange(W - 1, device=x.device).view(1, W - 1, 1)
        new_state = full.gather(1, idx.expand(B, W - 1, C))
    y = F.silu(y, inplace=True) if silu else y
    # States are small: contiguous copies (custom operators promise contiguous outputs).
    new_state = new_state.transpose(1, 2).contiguous()
    if at is None:
        return y, new_state
    rows, offsets = at
    idx = offsets.view(-1, 1) + torch.arange(W - 1, device=x.device).view(1, W - 1)
    return y, new_state, full[rows.view(-1, 1), idx].transpose(1, 2).contiguous()
