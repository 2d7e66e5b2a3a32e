"""`HostPool`: the DRAM tier's slots. Slot i holds one page: its KV in the KV pool and its
anchor block in the anchor pool (two physical buffers, one slot id, one LRU decision).

Buffers are 4 KiB-aligned (O_DIRECT reads and writes land in them without a bounce buffer)
and pinned when CUDA is present (asynchronous host <-> device copies). Slot strides are
`PageLayout.kv_stride` / `anchor_stride`, multiples of 4 KiB, so every slot is aligned.
"""

from __future__ import annotations

import torch

from backend.cache.page_io import ALIGN, AnchorBlock, PageLayout
from backend.cache.pools import PagePool


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose data starts on an `ALIGN` boundary."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % ALIGN
    return raw[offset : offset + nbytes]


def cuda_present() -> bool:
    return torch.cuda.is_available()


class HostPool:
    """`num_slots` page slots in DRAM with exact accounting (a `PagePool` of slot ids)."""

    def __init__(self, layout: PageLayout, num_slots: int, pin: bool | None = None) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.pinned = cuda_present() if pin is None else pin
        self.slots = PagePool(num_slots, "host")
        self.kv = aligned_empty(num_slots * layout.kv_stride, self.pinned).view(
            num_slots, layout.kv_stride
        )
        self.anchors = aligned_empty(num_slots * layout.anchor_stride, self.pinned).view(
            num_slots, layout.anchor_stride
        )

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    def alloc(self) -> int | None:
        ids = self.slots.alloc(1)
        return ids[0] if ids else None

    def free(self, slot: int) -> None:
        self.slots.free([slot])

    def kv_view(self, slot: int) -> torch.Tensor:
        """Typed view `[A, 2, page_size, Hkv, Dh]` of a slot's KV."""
        lay = self.layout
        raw = self.kv[slot, : lay.kv_bytes]
        return raw.view(getattr(torch, lay.kv_dtype)).view(lay.kv_shape)

    def anchor_view(self, slot: int) -> AnchorBlock:
        """Typed views of a slot's anchor block: rows `[G, a, D]` (and their scales `[G, a]`
        before them, for int8 anchors)."""
        lay = self.layout
        head = lay.anchor_scale_bytes
        rows = self.anchors[slot, head : lay.anchor_bytes]
        rows = rows.view(getattr(torch, lay.anchor_dtype)).view(lay.anchor_shape)
        if not lay.anchor_scales:
            return AnchorBlock(rows)
        scales = self.anchors[slot, :head].view(torch.float32).view(lay.anchor_shape[:2])
        return AnchorBlock(rows, scales)

    def io_buffers(self, slot: int) -> list[memoryview]:
        """The slot's padded sections as aligned byte buffers, in chunk-file order."""
        bufs = [memoryview(self.kv[slot].numpy())]
        if self.layout.has_anchors:
            bufs.append(memoryview(self.anchors[slot].numpy()))
        return bufs

    def payload(self, slot: int) -> list[memoryview]:
        """The slot's unpadded KV and anchor bytes (what the checksum covers)."""
        lay = self.layout
        bufs = [memoryview(self.kv[slot, : lay.kv_bytes].numpy())]
        if lay.has_anchors:
            bufs.append(memoryview(self.anchors[slot, : lay.anchor_bytes].numpy()))
        return bufs
