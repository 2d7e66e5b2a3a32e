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
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T, C]; weight: [C, W]; state: [B, C, W - 1] or None (zeros).

    Returns silu(conv(x)) (conv(x) with silu=False) [B, T, C] and the new state
    [B, C, W - 1]: the last W - 1 inputs
    before each sequence's end (`lengths` [B] for right-padded batches, else T).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    xt = x.transpose(1, 2)
    if state is None:
        state = xt.new_zeros(B, C, W - 1)
    full = torch.cat((state.to(xt.dtype), xt), dim=-1)  # [B, C, W - 1 + T]
    if T == 1:
        y = (full * weight).sum(-1, keepdim=True)
    else:
        y = F.conv1d(full, weight.unsqueeze(1), groups=C)
    if lengths is None:
        new_state = full[..., T:]
    else:
        idx = lengths.view(B, 1, 1) + torch.arange(W - 1, device=x.device).view(1, 1, W - 1)
        new_state = full.gather(2, idx.expand(B, C, W - 1))
    return (F.silu(y) if silu else y).transpose(1, 2), new_state
