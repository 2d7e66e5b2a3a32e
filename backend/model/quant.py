"""int8 anchors with one scale per token (row): x ~= q * scale, q in [-127, 127]."""

from __future__ import annotations

import torch


def quantize_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows: [..., D] float -> (q int8 [..., D], scale fp32 [...])."""
    scale = rows.float().abs().amax(-1).clamp_min(1e-12) / 127.0
    q = torch.round(rows.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
