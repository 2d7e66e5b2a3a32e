"""The fused fp32 paths of the Qwen3.5 norms equal their written-out definitions bit for bit;
other dtypes take the definition itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.model.norm import GatedRMSNorm, RMSNorm


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 1, 4, 64), (5, 128)])
def test_fp32_norms_are_bit_identical_to_the_definition(shape):
    torch.manual_seed(sum(shape))
    x, gate = torch.randn(*shape) * 3, torch.randn(*shape)
    norm, gated = RMSNorm(shape[-1]), GatedRMSNorm(shape[-1])
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(gated.weight)
    assert torch.equal(norm(x), _rms(x, norm.eps) * (1.0 + norm.weight))
    assert torch.equal(gated(x, gate), gated.weight * _rms(x, gated.eps) * F.silu(gate))


def test_bf16_norms_compute_in_fp32_and_cast_back():
    torch.manual_seed(0)
    x, gate = torch.randn(4, 96).bfloat16(), torch.randn(4, 96).bfloat16()
    norm, gated = RMSNorm(96).bfloat16(), GatedRMSNorm(96).bfloat16()
    torch.nn.init.normal_(norm.weight)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    want = (_rms(x, norm.eps) * (1.0 + norm.weight.float())).bfloat16()
    assert torch.equal(y, want)
    g = gated(x, gate)
    assert g.dtype == torch.bfloat16
    want = ((gated.weight * _rms(x, gated.eps).bfloat16()) * F.silu(gate.float())).bfloat16()
    assert torch.equal(g, want)
