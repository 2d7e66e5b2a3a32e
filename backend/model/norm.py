"""RMSNorm variants of the Qwen3.5 and Nemotron-H families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = norm(x) * (1 + w), computed in fp32 then cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same arithmetic in one fused call (bit-identical in fp32).
            return F.rms_norm(x, (x.shape[-1],), 1.0 + self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """Norm-then-gate used on the Gated DeltaNet output: w * norm(x) * silu(z)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.dtype == gate.dtype == self.weight.dtype == torch.float32:
            # The same arithmetic in two fused calls (bit-identical in fp32).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps) * F.silu(gate)
        dtype = x.dtype
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class PlainRMSNorm(nn.Module):
    """Nemotron-H's RMSNorm: y = w * norm(x) (weights around 1), in fp32 then cast back."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class GroupGatedRMSNorm(nn.Module):
    """Gate-then-norm of the Mamba2 output: w * norm_g(x * silu(z)), normalised over groups of
    `group_size` channels (Nemotron-H: one group per B/C group)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        h = h.unflatten(-1, (-1, self.group_size))
        h = F.rms_norm(h, (self.group_size,), None, self.eps).flatten(-2)
        return self.weight * h.to(dtype)
