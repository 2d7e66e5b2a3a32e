"""`DeviceBuffers`: the engine's device KV pages and anchor blocks as the tiers read and write
them, the `PageLayout` of one page in DRAM and on SSD, and `CopyStream` (where device <->
host copies run).

Device layout (owned by the executor): per attention layer a, `k[a]` and `v[a]` are
`[num_kv_pages * page_size, Hkv, Dh]` and KV page p is rows `[p*page_size, (p+1)*page_size)`;
anchors are `[G, num_anchor_blocks * a, D]` and anchor block b is rows `[b*a, (b+1)*a)`.
Host / SSD layout of one page: KV `[A, 2, page_size, Hkv, Dh]` (layer-major, so one layer of
a page is contiguous for layer-wise transfers) and anchors `[G, a, D]`, each section padded
to `ALIGN` bytes so that O_DIRECT can move it without a bounce buffer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (covers 512 B sectors)


def align_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


class PageLayout(NamedTuple):
    """Shape of one page's KV (all attention layers) and anchor block (all groups)."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    num_groups: int = 0
    anchors_per_page: int = 0
    hidden_size: int = 0
    anchor_dtype: str = "float32"
    anchor_scales: bool = False  # int8 anchors: one fp32 scale per row, before the rows
    # Where a page's anchors lie ("dense_tail" / "uniform"): the same bytes mean other token
    # positions under another sampling, so a chunk written under one is a miss under another.
    anchor_sampling: str = ""

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def anchor_shape(self) -> tuple[int, ...]:
        return (self.num_groups, self.anchors_per_page, self.hidden_size)

    @property
    def kv_bytes(self) -> int:
        return _numel(self.kv_shape) * _itemsize(self.kv_dtype)

    @property
    def layer_bytes(self) -> int:
        return self.kv_bytes // self.num_layers

    @property
    def anchor_scale_bytes(self) -> int:
        return self.num_groups * self.anchors_per_page * 4 if self.anchor_scales else 0

    @property
    def anchor_bytes(self) -> int:
        """An anchor block: its scales (int8 anchors; first, so both views are aligned),
        then its rows."""
        return self.anchor_scale_bytes + _numel(self.anchor_shape) * _itemsize(self.anchor_dtype)

    @property
    def kv_stride(self) -> int:
        return align_up(self.kv_bytes)

    @property
    def anchor_stride(self) -> int:
        return align_up(self.anchor_bytes)

    @property
    def has_anchors(self) -> bool:
        return self.anchor_bytes > 0

    def describe(self) -> str:
        """Canonical text of the layout, stored in every SSD chunk header (`anchor_scales`
        and `anchor_sampling` only where set, so layouts without them read as they were
        written before them)."""
        fields = self._asdict()
        for optional in ("anchor_scales", "anchor_sampling"):
            if not fields[optional]:
                del fields[optional]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))


class AnchorBlock(NamedTuple):
    """Typed views of one anchor block: rows [G, a, D] and, for int8 anchors, their scales
    [G, a] (fp32)."""

    rows: torch.Tensor
    scales: torch.Tensor | None = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: str) -> int:
    # (The layouts' byte sizes are read for every page moved: no tensor is built for this.)
    return getattr(torch, dtype).itemsize


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """dst <- src. Between CPU tensors of one dtype this is a plain single-threaded memcpy
    (numpy, GIL released): torch's copy_ splits a page-sized copy over the intra-op pool,
    which is 100x slower when the other cores are busy (measured: 128 KiB in 4.5 ms)."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.stride(-1) == src.stride(-1) == 1
    ):
        np.copyto(_as_bytes(dst), _as_bytes(src))
    else:
        dst.copy_(src, non_blocking=non_blocking)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()  # bf16 has no numpy dtype: move raw bytes


class DeviceBuffers:
    """Reads and writes one page's KV (all layers) and one anchor block in the engine's
    buffers. k, v: per attention layer `[P * page_size, Hkv, Dh]`; anchors: `[G, B * a, D]`
    or None (no SuffixReplay anchors); anchor_scales: `[G, B * a]` fp32 for int8 anchors;
    anchor_sampling: where the anchors lie in their page (part of the layout the SSD tier
    checks: `PageLayout.anchor_sampling`)."""

    def __init__(
        self,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        page_size: int,
        anchors: torch.Tensor | None = None,
        anchors_per_page: int = 0,
        states: Any = None,
        anchor_scales: torch.Tensor | None = None,
        anchor_sampling: str = "",
    ) -> None:
        if not k or len(k) != len(v):
            raise ValueError(f"need one k and one v per attention layer, got {len(k)}, {len(v)}")
        shape = tuple(k[0].shape)
        if any(tuple(t.shape) != shape for t in (*k, *v)) or len(shape) != 3:
            raise ValueError(f"k/v must all be [P * page_size, Hkv, Dh], got {shape}")
        if page_size < 1 or shape[0] % page_size:
            raise ValueError(f"{shape[0]} KV rows are not a whole number of {page_size}-pages")
        self.k, self.v, self.page_size = list(k), list(v), page_size
        self.anchors = anchors
        self.anchor_scales = anchor_scales if anchors is not None else None
        if self.anchor_scales is not None and (
                anchors.dtype != torch.int8 or self.anchor_scales.shape != anchors.shape[:2]):
            raise ValueError("anchor scales go with int8 anchors, one per row")
        self.states = states  # the executor's saved-state StateSlots (checkpoints), or None
        self.anchors_per_page = anchors_per_page if anchors is not None else 0
        if anchors is not None and (anchors_per_page < 1 or anchors.shape[1] % anchors_per_page):
            raise ValueError(
                f"{anchors.shape[1]} anchor rows are not whole blocks of {anchors_per_page}"
            )
        self.device = k[0].device
        self.layout = PageLayout(
            num_layers=len(k),
            page_size=page_size,
            num_kv_heads=shape[1],
            head_dim=shape[2],
            kv_dtype=_dtype_name(k[0].dtype),
            num_groups=anchors.shape[0] if anchors is not None else 0,
            anchors_per_page=self.anchors_per_page,
            hidden_size=anchors.shape[2] if anchors is not None else 0,
            anchor_dtype=_dtype_name(anchors.dtype) if anchors is not None else "float32",
            anchor_scales=self.anchor_scales is not None,
            anchor_sampling=anchor_sampling if anchors is not None else "",
        )

    @classmethod
    def from_executor(cls, executor: Any, anchors_per_page: int, with_anchors: bool = True,
                      anchor_sampling: str = ""):
        """From a `TorchExecutor` (its `kv` PagedKV, `anchors` tensor and saved states)."""
        anchors = executor.anchors if with_anchors and anchors_per_page > 0 else None
        return cls(executor.kv.k, executor.kv.v, executor.kv.page_size, anchors, anchors_per_page,
                   getattr(executor, "saved_states", None),
                   getattr(executor, "anchor_scales", None), anchor_sampling)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0] // self.page_size

    @property
    def num_anchor_blocks(self) -> int:
        return 0 if self.anchors is None else self.anchors.shape[1] // self.anchors_per_page

    def _rows(self, page: int) -> slice:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"KV page {page} is not in [0, {self.num_pages})")
        return slice(page * self.page_size, (page + 1) * self.page_size)

    def _anchor_rows(self, block: int) -> slice:
        if not 0 <= block < self.num_anchor_blocks:
            raise ValueError(f"anchor block {block} is not in [0, {self.num_anchor_blocks})")
        a = self.anchors_per_page
        return slice(block * a, (block + 1) * a)

    # host_kv: [A, 2, page_size, Hkv, Dh]; host_anchor: an AnchorBlock (typed views of DRAM
    # slots)
    def copy_layer_out(self, layer: int, page: int, host_kv: torch.Tensor, nb: bool = False):
        rows = self._rows(page)
        copy_tensor(host_kv[layer, 0], self.k[layer][rows], nb)
        copy_tensor(host_kv[layer, 1], self.v[layer][rows], nb)

    def copy_layer_in(self, layer: int, page: int, host_kv: torch.Tensor, nb: bool = False):
        rows = self._rows(page)
        copy_tensor(self.k[layer][rows], host_kv[layer, 0], nb)
        copy_tensor(self.v[layer][rows], host_kv[layer, 1], nb)

    def copy_page_out(self, page: int, host_kv: torch.Tensor, nb: bool = False) -> None:
        for layer in range(len(self.k)):
            self.copy_layer_out(layer, page, host_kv, nb)

    def copy_page_in(self, page: int, host_kv: torch.Tensor, nb: bool = False) -> None:
        for layer in range(len(self.k)):
            self.copy_layer_in(layer, page, host_kv, nb)

    def copy_anchor_out(self, block: int, host_anchor: AnchorBlock, nb: bool = False) -> None:
        rows = self._anchor_rows(block)
        copy_tensor(host_anchor.rows, self.anchors[:, rows], nb)
        if self.anchor_scales is not None:
            copy_tensor(host_anchor.scales, self.anchor_scales[:, rows], nb)

    def copy_anchor_in(self, block: int, host_anchor: AnchorBlock, nb: bool = False) -> None:
        rows = self._anchor_rows(block)
        copy_tensor(self.anchors[:, rows], host_anchor.rows, nb)
        if self.anchor_scales is not None:
            copy_tensor(self.anchor_scales[:, rows], host_anchor.scales, nb)


class CopyStream:
    """Where device <-> host copies run. CPU buffers: inline, synchronous. CUDA buffers: a side
    stream with non-blocking copies from pinned memory; the compute stream is ordered after
    each batch, and `ready()` hands I/O threads a wait for the host side to be complete."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self.is_cuda else None

    @property
    def stream(self):
        """The side CUDA stream, or None on CPU."""
        return self._stream

    @property
    def non_blocking(self) -> bool:
        return self.is_cuda

    def run(self, copies: Callable[[], None]) -> Callable[[], None] | None:
        """Runs `copies` (device <-> host); returns None on CPU (done), or on CUDA a callable
        that blocks until they completed (for threads that then read the host buffers)."""
        if self._stream is None:
            copies()
            return None
        with torch.cuda.stream(self._stream):
            copies()
            event = torch.cuda.Event()
            event.record(self._stream)
        torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return event.synchronize

    def fence(self) -> None:
        """Blocks until every copy issued so far completed (before a host slot is reused)."""
        if self._stream is not None:
            self._stream.synchronize()
