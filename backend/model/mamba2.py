"""The Mamba2 token mixer (Nemotron-H), with the interface of `GatedDeltaNet`: state in,
state out, ragged batches, mid-forward snapshots, state-only replay.

Parameter names follow the Hugging Face Nemotron-H checkpoints (`mixer.in_proj`,
`mixer.conv1d`, `mixer.dt_bias`, `mixer.A_log`, `mixer.D`, `mixer.norm`, `mixer.out_proj`).
The states use the `StateSlots` layout: conv [B, conv_dim, W - 1] over the x, B and C
channels, recurrent [B, heads, d_state, head_dim] in fp32 (transformers keeps it as
[B, heads, head_dim, d_state]: the same numbers transposed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import ModelConfig
from backend.model.conv import causal_conv1d
from backend.model.linear import Linear
from backend.model.mamba_scan import chunk_ssd, recurrent_ssd
from backend.model.norm import GroupGatedRMSNorm

LinearState = tuple[torch.Tensor, torch.Tensor]  # (conv [B, C, W - 1], recurrent [B, H, N, P])


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.n_groups, self.d_state = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.inner = cfg.linear_value_dim  # heads * head_dim
        self.conv_dim = cfg.conv_dim  # inner + 2 * n_groups * d_state
        self.dt_lo, self.dt_hi = cfg.extra.get("dt_limit", (0.0, float("inf")))
        W = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, W, groups=self.conv_dim,
                                bias=bool(cfg.extra.get("use_conv_bias", True)), padding=W - 1)
        self.in_proj = Linear(D, self.inner + self.conv_dim + self.num_heads,
                              bias=bool(cfg.extra.get("mamba_proj_bias", False)))
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1).float()))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GroupGatedRMSNorm(self.inner, self.inner // self.n_groups, cfg.rms_norm_eps)
        self.out_proj = Linear(self.inner, D, bias=bool(cfg.extra.get("mamba_proj_bias", False)))

    def forward(
        self,
        x: torch.Tensor,
        state: LinearState | None = None,
        valid: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        output: bool = True,
        snapshot_at: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """x: [B, T, D]; the rest as `GatedDeltaNet.forward` (valid / lengths for
        right-padded rows, output=False for the final states only, `snapshot_at` for the
        states after chunk-aligned offsets as a third result)."""
        B, T, _ = x.shape
        if valid is not None:
            x = x * valid.unsqueeze(-1).to(x.dtype)
        conv_state, rec_state = state if state is not None else (None, None)
        z, xbc, dt = self.project(x)
        conv = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), conv_state, lengths,
                             at=snapshot_at, bias=self.conv1d.bias)
        q, k, v, g, xs = self.scan_inputs(conv[0], dt, valid)
        if T == 1 and snapshot_at is None:
            res = recurrent_ssd(q, k, v, g, initial_state=rec_state)
        else:
            res = chunk_ssd(q, k, v, g, initial_state=rec_state, output=output,
                            states_at=snapshot_at)
        out = self.output(res[0], xs, z, x.dtype) if output else None
        if snapshot_at is None:
            return out, (conv[1], res[1])
        return out, (conv[1], res[1]), (conv[2], res[2])

    # The pieces around the conv and the scan, shared with the packed graphs (`packed.py`);
    # any leading shape ([B, T] here, [N] packed tokens there).
    def project(self, x: torch.Tensor):
        """x [*, D] -> the gate z [*, inner], the conv's input xBC [*, conv_dim], raw dt [*, H]."""
        return self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)

    def scan_inputs(self, xbc: torch.Tensor, dt: torch.Tensor, valid: torch.Tensor | None = None):
        """The conv's output and raw dt -> the scan's q = C, k = B [*, H, N] (expanded from
        the groups), v = dt * x [*, H, P] (fp32), g = dt * A [*, H], and x [*, H, P].
        `valid` [*]: dt = 0 at padding (no decay and no write: the state passes it by)."""
        xs, b, c = xbc.split([self.inner, self.n_groups * self.d_state,
                              self.n_groups * self.d_state], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_lo, self.dt_hi)
        if valid is not None:
            dt = dt * valid.unsqueeze(-1)
        lead = xs.shape[:-1]
        xs = xs.reshape(*lead, self.num_heads, self.head_dim)
        rep = self.num_heads // self.n_groups
        k = b.reshape(*lead, self.n_groups, self.d_state).repeat_interleave(rep, dim=-2)
        q = c.reshape(*lead, self.n_groups, self.d_state).repeat_interleave(rep, dim=-2)
        return q, k, xs.float() * dt.unsqueeze(-1), dt * -self.A_log.float().exp(), xs

    def output(self, y: torch.Tensor, xs: torch.Tensor, z: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
        """The scan's output y [*, H, P] -> the mixer's: D skip, gated group norm, out_proj."""
        y = y.float() + xs.float() * self.D.float()[:, None]
        return self.out_proj(self.norm(y.flatten(-2), z).to(dtype))
