"""Full attention with grouped KV heads and paged KV: Qwen3.5's (q/k norm, partial rotary,
output gate) or Nemotron-H's (plain: no norm, no positional encoding, no gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import ModelConfig
from backend.model.batch import ForwardBatch
from backend.model.linear import Linear
from backend.model.norm import RMSNorm
from backend.model.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_index: int) -> None:
        super().__init__()
        self.attn_index = attn_index  # index among attention layers: selects the KV buffer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        D, Dh, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.gated = not cfg.is_nemotron_h
        # Qwen3.5: q_proj emits the query and the output gate interleaved per head: [H, 2 * Dh].
        self.q_proj = Linear(D, self.num_heads * Dh * (2 if self.gated else 1), bias=bias)
        self.k_proj = Linear(D, self.num_kv_heads * Dh, bias=bias)
        self.v_proj = Linear(D, self.num_kv_heads * Dh, bias=bias)
        self.o_proj = Linear(self.num_heads * Dh, D, bias=bias)
        if self.gated:
            self.q_norm = RMSNorm(Dh, eps=cfg.rms_norm_eps)
            self.k_norm = RMSNorm(Dh, eps=cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        """x: [B, T, D]; cos, sin: [B, T, R] (unused without rotary) -> [B, T, D]."""
        B, T, _ = x.shape
        if self.gated:
            q, gate = self.q_proj(x).view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, -1)
            q = apply_rotary(self.q_norm(q), cos, sin)
            k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, -1))
            k = apply_rotary(k, cos, sin)
        else:
            q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        kv = batch.kv if batch is not None else None
        if kv is not None:
            rows, slots = batch.write_rows, batch.write_slots
            kv.k[self.attn_index].index_copy_(0, slots, k.reshape(B * T, *k.shape[2:])[rows])
            kv.v[self.attn_index].index_copy_(0, slots, v.reshape(B * T, *v.shape[2:])[rows])
            if batch.layer_hooks is not None:
                batch.layer_hooks.after_write(self.attn_index)
                batch.layer_hooks.before_read(self.attn_index)
        if kv is None or batch.fresh:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=T > 1, enable_gqa=True,
            )
        else:
            k_ctx, v_ctx = self._context(kv, batch)  # [B, Ctx, Hkv, Dh]
            mask = batch.attn_mask
            if B == 1 and T == 1:
                mask = None  # one query sees its whole (exact) context
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                attn_mask=mask, enable_gqa=True,
            )
        out = out.transpose(1, 2).reshape(B, T, -1)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out)

    def _context(self, kv, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every context token, [B, Ctx, Hkv, Dh], gathered a page at a
        time (`read_pages`). Keys past a row's context are other pages' (or padding) and
        masked."""
        B, ctx = batch.read_pages.shape[0], batch.context_len

        pages = batch.read_pages.reshape(-1)

        def gather(pool: torch.Tensor) -> torch.Tensor:
            # index_select copies whole pages (8x faster on the CPU than advanced indexing
            # with the [B, P] table, which computes an offset per element)
            paged = pool.view(-1, kv.page_size, *pool.shape[1:]).index_select(0, pages)
            return paged.view(B, -1, *pool.shape[1:])[:, :ctx]  # [B, P * page, H, D] cut

        return gather(kv.k[self.attn_index]), gather(kv.v[self.attn_index])
