"""Runtime buffers the model reads and writes: paged full-attention KV and linear-state slots.

The model never allocates pages or slots; whoever owns these buffers (the engine through the
prefix store, or `generate.py` for standalone use) hands the model page tables and slot ids.
KV of attention layer `a` lives in `k[a]`, `v[a]`: [num_pages * page_size, Hkv, Dh], so token
`t` of a sequence sits at flat slot `page_table[t // page_size] * page_size + t % page_size`.
A page referenced by two page tables is read in place by both; it is never copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.config import ModelConfig


@dataclass
class PagedKV:
    k: list[torch.Tensor]  # per attention layer: [P * page_size, Hkv, Dh]
    v: list[torch.Tensor]
    page_size: int

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> PagedKV:
        shape = (num_pages * page_size, cfg.num_key_value_heads, cfg.head_dim)
        n = len(cfg.attention_layer_ids)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            page_size=page_size,
        )

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0] // self.page_size if self.k else 0


@dataclass
class StateSlots:
    """Recurrent ([S, Hv, K, V], fp32) and conv ([S, conv_dim, W - 1]) states per linear layer."""

    conv: list[torch.Tensor]
    rec: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> StateSlots:
        n = len(cfg.linear_layer_ids)
        conv_shape = (num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
        rec_shape = (
            num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )
        return cls(
            conv=[torch.zeros(conv_shape, dtype=dtype, device=device) for _ in range(n)],
            rec=[torch.zeros(rec_shape, dtype=torch.float32, device=device) for _ in range(n)],
        )

    @property
    def num_slots(self) -> int:
        return self.rec[0].shape[0] if self.rec else 0

    def read(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of (conv, rec) for every linear layer of one slot."""
        return [(c[slot].clone(), r[slot].clone()) for c, r in zip(self.conv, self.rec)]

    def write(self, slot: int, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for (c, r), (cs, rs) in zip(zip(self.conv, self.rec), states):
            c[slot].copy_(cs)
            r[slot].copy_(rs)

    def scatter(self, layer: int, slots: torch.Tensor, conv: torch.Tensor,
                rec: torch.Tensor) -> None:
        """conv [M, C, W - 1] and rec [M, H, K, V] of linear layer `layer` into `slots` [M]."""
        self.conv[layer].index_copy_(0, slots, conv.to(self.conv[layer].dtype))
        self.rec[layer].index_copy_(0, slots, rec)

    def zero(self, slot: int) -> None:
        for c, r in zip(self.conv, self.rec):
            c[slot].zero_()
            r[slot].zero_()


def token_slots(page_table: torch.Tensor, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat KV slots of tokens [start, end) of a sequence with this page table: [end - start]."""
    pos = torch.arange(start, end)
    return page_table[pos // page_size] * page_size + pos % page_size
