"""Gated DeltaNet token mixer (the linear-attention layer of Qwen3.5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import ModelConfig
from backend.model.conv import causal_conv1d
from backend.model.delta_rule import chunk_gated_delta_rule
from backend.model.kernels import delta_rule_for
from backend.model.linear import Linear
from backend.model.norm import GatedRMSNorm

LinearState = tuple[torch.Tensor, torch.Tensor]  # (conv [B, C, W - 1], recurrent [B, H, K, V])


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.conv_dim = cfg.conv_dim
        W = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, W, groups=self.conv_dim, bias=False,
                                padding=W - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(1, 16)))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, D, bias=False)
        self.in_proj_qkv = Linear(D, self.conv_dim, bias=False)
        self.in_proj_z = Linear(D, self.value_dim, bias=False)
        self.in_proj_b = Linear(D, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(D, self.num_v_heads, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        state: LinearState | None = None,
        valid: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        output: bool = True,
        snapshot_at: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """x: [B, T, D]; state: initial (conv, recurrent) or None for zeros.

        valid: [B, T] marks real tokens of a right-padded batch (padding leaves states
        untouched); lengths: [B] real lengths. Returns the output and the final states;
        output=False: (None, final states), without the output's work. With `snapshot_at`
        = (rows [M], offsets [M], chunk-aligned) a third result: the (conv, recurrent)
        states after those tokens (`chunk_gated_delta_rule` form only: see
        `supports_snapshots`).
        """
        B, T, _ = x.shape
        if valid is not None:
            x = x * valid.unsqueeze(-1).to(x.dtype)
        conv_state, rec_state = state if state is not None else (None, None)
        conv = causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), conv_state,
                             lengths, at=snapshot_at)
        mixed, new_conv = conv[0], conv[1]
        q, k, v = self.split_heads(mixed)
        beta, g = self.gates(x)
        if valid is not None:
            keep = valid.unsqueeze(-1)
            beta, g = beta * keep, g * keep
        rule = delta_rule_for(x, T)
        kw = {}
        if rule is chunk_gated_delta_rule:
            kw = {"output": output, "states_at": snapshot_at}
        elif snapshot_at is not None:
            raise ValueError("mid-forward snapshots need the chunked PyTorch delta rule")
        res = rule(q, k, v, g, beta, initial_state=rec_state, **kw)
        out = self.output(res[0], x) if output else None
        if snapshot_at is None:
            return out, (new_conv, res[1])
        return out, (new_conv, res[1]), (conv[2], res[2])

    # Pieces shared with the packed form (backend/model/packed.py); any leading shape.
    def split_heads(self, mixed: torch.Tensor):
        """Conv output [..., conv_dim] -> q, k (L2-normalised fp32, expanded to the value
        heads) [..., Hv, K] and v [..., Hv, V]."""
        lead = mixed.shape[:-1]
        qk, v = mixed.split([2 * self.key_dim, self.value_dim], dim=-1)
        # q and k heads side by side: one normalisation (and one expansion) for both.
        qk = qk.reshape(*lead, 2 * self.num_k_heads, self.head_k_dim)
        qk = l2norm(qk.float())
        v = v.reshape(*lead, self.num_v_heads, self.head_v_dim)
        if self.num_v_heads != self.num_k_heads:
            qk = qk.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=-2)
        q, k = qk.chunk(2, dim=-2)
        return q, k, v

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) and the log decay g (<= 0), [..., Hv]."""
        return self.gates_of(self.in_proj_b(x), self.in_proj_a(x))

    def gates_of(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`gates` from the b and a projections."""
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def output(self, out: torch.Tensor, x: torch.Tensor, z: torch.Tensor | None = None):
        """Gated RMSNorm with z = in_proj_z(x) (or the given z), then the out projection."""
        z = (self.in_proj_z(x) if z is None else z).reshape(*out.shape)
        return self.out_proj(self.norm(out, z).reshape(*x.shape[:-1], self.value_dim))
