"""Per-forward metadata: which tokens each sequence adds, where its KV and states live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from backend.model.kv_cache import PagedKV, StateSlots, token_slots
from backend.model.quant import quantize_int8


class Capture(NamedTuple):
    """Where to copy group-entry hidden states during a forward.

    src: [N] flat indices into the batch's [B * T] token rows; dst: [N] rows of each group's
    buffer; buffers: [G, R, D] (one [R, D] buffer per group). One indexed copy per group.
    With `scales` [G, R] the buffers are int8 and each row is stored with its own scale.
    """

    src: torch.Tensor
    dst: torch.Tensor
    buffers: torch.Tensor
    scales: torch.Tensor | None = None

    def write(self, group: int, hidden: torch.Tensor) -> None:
        """hidden: [B, T, D] entering the group's first layer."""
        rows = hidden.reshape(-1, hidden.shape[-1])[self.src]
        if self.scales is None:
            self.buffers[group].index_copy_(0, self.dst, rows.to(self.buffers.dtype))
            return
        q, scale = quantize_int8(rows)
        self.buffers[group].index_copy_(0, self.dst, q)
        self.scales[group].index_copy_(0, self.dst, scale)


class Snapshots(NamedTuple):
    """Linear states to save in the middle of a forward (checkpoints without splitting it).

    rows: [M] batch rows; offsets: [M] token counts into each row's new tokens, multiples of
    SNAPSHOT_ALIGN (the chunked delta rule's chunk size, where the state exists anyway);
    slots: [M] destination slots of `pool`. The state saved is the one after the row's first
    `offset` new tokens, exactly what a forward ending there would leave.
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor
    pool: StateSlots

    def write(self, index: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """conv [M, C, W - 1] and rec [M, H, K, V] of linear layer `index`."""
        self.pool.scatter(index, self.slots, conv, rec)


SNAPSHOT_ALIGN = 64


@dataclass
class SeqInput:
    """One sequence of a batch: `token_ids` follow `start` tokens already in KV / states."""

    token_ids: list[int] | torch.Tensor
    start: int = 0
    page_table: torch.Tensor | None = None  # pages covering [0, start + len(token_ids))
    state_slot: int | None = None
    adapter: int = 0  # the LoRA adapter it runs on (`backend/model/lora.py`; 0: none)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, T], right-padded with 0
    positions: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]
    starts: list[int]
    valid: torch.Tensor | None  # [B, T] bool; None when no row is padded
    kv: PagedKV | None = None
    states: StateSlots | None = None
    state_slots: torch.Tensor | None = None  # [B]
    write_rows: torch.Tensor | None = None  # [N] flat rows of real tokens in [B * T]
    write_slots: torch.Tensor | None = None  # [N] their KV slots
    context_len: int = 0  # Ctx: the longest context (cached + new tokens) a row reads
    read_pages: torch.Tensor | None = None  # [B, P] each row's context pages (P * page >= Ctx)
    attn_mask: torch.Tensor | None = None  # [B, 1, T, Ctx] bool
    capture: Capture | None = None
    # Layer-wise transfer hooks (tiered KV): `after_write(a)` once attention layer a wrote its
    # new KV, `before_read(a)` before it reads cached KV.
    layer_hooks: object | None = None
    fresh_rows: torch.Tensor | None = None  # [B] bool: rows that start from zero state
    snapshots: Snapshots | None = None  # states saved mid-forward
    # Set by the caller to record the inputs of a multi-token step's recurrences (the CPU
    # fast path's `decode.StateLog`), from which a row's states after fewer of its tokens
    # can be rebuilt (speculative decoding's rejected drafts).
    state_log: object | None = None
    lora: torch.Tensor | None = None  # [B] each row's LoRA adapter; None: no row has one

    @property
    def fresh(self) -> bool:
        """Every sequence starts at 0: attention needs only this forward's own K/V."""
        return all(s == 0 for s in self.starts)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def read_slots(self) -> torch.Tensor | None:
        """[B, Ctx] flat KV slot of every context token (what a token-wise gather reads; the
        compiled engine's input), from `read_pages`; None for a fresh batch. Slots past a
        row's context point into padding pages and are masked."""
        if self.read_pages is None:
            return None
        ps = self.kv.page_size
        B, P = self.read_pages.shape
        offsets = torch.arange(ps, device=self.read_pages.device)
        slots = (self.read_pages.unsqueeze(-1) * ps + offsets).view(B, P * ps)
        return slots[:, :self.context_len].contiguous()

    @classmethod
    def build(
        cls,
        seqs: list[SeqInput],
        kv: PagedKV | None = None,
        states: StateSlots | None = None,
        capture: Capture | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        if not seqs:
            raise ValueError("a forward batch needs at least one sequence")
        lens = [len(s.token_ids) for s in seqs]
        if min(lens) < 1:
            raise ValueError(f"every sequence must add at least one token, got lengths {lens}")
        B, T = len(seqs), max(lens)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : lens[b]] = torch.as_tensor(s.token_ids, dtype=torch.long)
        starts = [s.start for s in seqs]
        lengths = torch.tensor(lens)
        ar = torch.arange(T)
        positions = torch.tensor(starts).unsqueeze(1) + ar
        valid = None if min(lens) == T else ar.unsqueeze(0) < lengths.unsqueeze(1)
        batch = cls(ids, positions, lengths, starts, valid, kv, states, capture=capture)
        if any(s.adapter for s in seqs):
            batch.lora = torch.tensor([s.adapter for s in seqs])
        if kv is not None:
            batch._plan_kv(seqs, lens, T)
        if states is not None:
            if any(s.state_slot is None for s in seqs):
                raise ValueError("every sequence needs a state_slot when states are given")
            batch.state_slots = torch.tensor([s.state_slot for s in seqs])
            if 0 in starts and not batch.fresh:
                batch.fresh_rows = torch.tensor([s == 0 for s in starts])
        elif any(s > 0 for s in starts):
            raise ValueError(f"sequences continue at {starts} but no state slots were given")
        return batch.to(device)

    def _plan_kv(self, seqs: list[SeqInput], lens: list[int], T: int) -> None:
        ps = self.kv.page_size
        rows, slots = [], []
        for b, (s, n) in enumerate(zip(seqs, lens)):
            if s.page_table is None:
                raise ValueError(f"sequence {b} has no page table but a KV cache is in use")
            need = -(-(s.start + n) // ps)
            if s.page_table.numel() < need:
                raise ValueError(
                    f"sequence {b}: page table has {s.page_table.numel()} pages, "
                    f"{need} are needed for {s.start + n} tokens"
                )
            rows.append(torch.arange(n) + b * T)
            slots.append(token_slots(s.page_table, s.start, s.start + n, ps))
        self.write_rows = torch.cat(rows)
        self.write_slots = torch.cat(slots)
        if not self.fresh:
            # Each row reads its context (the new tokens end it) page by page.
            ctx = self.context_len = max(s.start + n for s, n in zip(seqs, lens))
            pad = torch.nn.functional.pad
            pages = -(-ctx // ps)
            self.read_pages = torch.stack([pad(s.page_table[:pages].long(),
                                               (0, pages - min(pages, s.page_table.numel())))
                                           for s in seqs])
            key_pos = torch.arange(ctx).view(1, 1, 1, ctx)
            self.attn_mask = key_pos <= self.positions.view(len(seqs), 1, T, 1)

    def to(self, device: torch.device | str) -> ForwardBatch:
        for name in ("input_ids", "positions", "lengths", "valid", "state_slots", "write_rows",
                     "write_slots", "read_pages", "attn_mask", "fresh_rows", "lora"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self
