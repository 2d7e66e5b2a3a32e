"""Linear layers that multiply through a oneDNN-packed copy of their weight on the CPU.

`torch.nn.functional.linear` on the CPU goes through a generic GEMM whose small-batch path is
slow (decode multiplies 1-8 rows by every weight matrix of the model): a weight reordered once
into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with
`torch.ops.mkldnn._linear_pointwise` is 1.3-6x faster on this project's CPU for decode-sized
inputs and 1.2-1.5x for prefill-sized ones. Tiny products stay
on `F.linear`: oneDNN's per-call dispatch (~14 us) costs more than it saves below ~64K
multiply-adds (measured over all of the default model's linears in a row, where weights come
from memory, not cache: 2.3-2.4 ms against 3.0 ms with a 1M threshold at batch 1).

oneDNN builds (and caches, ~0.5-2 MB each, never returning the memory) one primitive per
input row count: a server whose steps carry any number of tokens grew by 1.5 GB in a 6-minute
soak when every row count reached it. So what reaches oneDNN has few row counts: up to
`MAX_PACKED_ROWS` rows (decode) are zero-padded up to a power of two; larger inputs (prefill,
replay; 1.2-1.5x faster products than `F.linear` on this CPU at 256-2048 rows, a 1024x12
model's whole prefill ~1.2x, the tiny default model's unchanged) are padded to a multiple
of `ROW_ALIGN` and cut into power-of-two pieces of at most `MAX_CHUNK_ROWS` rows. Every weight
shape thus sees at most 11 row counts (1, 2, 4, ..., 1024), whatever the batches.

`pack_linears(model)` (called by `load_model` on CPU models) snapshots every `Linear`'s weight;
the plain weight stays the parameter (state dicts, export and the compiled engine see an
ordinary `nn.Linear`), and the packed copy is used only for inference (no autograd), on CPU
inputs, outside `torch.compile` / `torch.export` tracing, while the parameter is still the one
that was packed. A weight edited in place after packing (its `_version` moves) is packed
again at its next inference call; `unpack_linears(model)` drops the copies.

Set SUFFIXREPLAY_PACKED_LINEAR=0 to turn packing off (for example to compare against it).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from backend.model import lora

MIN_MACS = 1 << 16  # below this many multiply-adds per call, F.linear is faster
MAX_PACKED_ROWS = 64  # up to here: padded to a power of two (see the module doc)
ROW_ALIGN = 64  # larger inputs: padded to a multiple of this and cut into pieces
MAX_CHUNK_ROWS = 1024  # the largest piece (a power-of-two multiple of ROW_ALIGN)
_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """oneDNN present, a CPU weight of a supported dtype (bf16 only where the CPU has
    oneDNN's bf16 instructions: AVX512-BF16 / AVX-NE-CONVERT), and not turned off by env."""
    return (torch.device(device).type == "cpu" and dtype in _DTYPES
            and torch.backends.mkldnn.is_available()
            and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and os.environ.get("SUFFIXREPLAY_PACKED_LINEAR", "1") != "0")


class Linear(nn.Linear):
    """`nn.Linear` with an optional oneDNN-packed weight for CPU inference (see module doc)."""

    _packed: torch.Tensor | None = None
    _packed_from: torch.Tensor | None = None  # the parameter the packed copy was made from
    _packed_version = -1  # and its version then (in-place edits move it)
    lora: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # adapter -> (A, scale B)

    def pack(self) -> None:
        w = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w)
        self._packed_version = self.weight._version
        # A plain attribute, not a second registration of the parameter.
        object.__setattr__(self, "_packed_from", self.weight)

    def unpack(self) -> None:
        self._packed = None
        object.__setattr__(self, "_packed_from", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        if self.lora is not None:  # LoRA adapters of this layer (`backend/model/lora.py`)
            return lora.apply(self.lora, x, y)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        p = self._packed
        if (p is not None and not torch.compiler.is_compiling() and not torch.is_grad_enabled()
                and x.is_cpu and x.dtype == p.dtype and self.weight is self._packed_from):
            rows = x.numel() // self.in_features
            if rows * self.in_features * self.out_features >= MIN_MACS:
                if self.weight._version != self._packed_version:
                    self.pack()  # edited in place since
                    p = self._packed
                if rows <= MAX_PACKED_ROWS:
                    return _packed_linear(x, rows, p, self.bias)
                return _packed_linear_pieces(x, rows, p, self.bias)
        return F.linear(x, self.weight, self.bias)


def _packed_linear(x: torch.Tensor, rows: int, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] through the packed weight, rows zero-padded to a power of two."""
    flat = x.reshape(rows, x.shape[-1])
    bucket = 1 << (rows - 1).bit_length()
    if bucket != rows:
        flat = F.pad(flat, (0, 0, 0, bucket - rows))
    y = _pointwise(flat, packed, bias, "none", [], "")
    return y[:rows].view(*x.shape[:-1], y.shape[-1])


def row_pieces(rows: int) -> list[tuple[int, int]]:
    """(start, size) pieces covering `rows` rounded up to ROW_ALIGN: each size a power-of-two
    multiple of ROW_ALIGN of at most MAX_CHUNK_ROWS, largest first."""
    total = -(-rows // ROW_ALIGN) * ROW_ALIGN
    pieces, start = [], 0
    while start < total:
        size = min(MAX_CHUNK_ROWS, 1 << ((total - start).bit_length() - 1))
        pieces.append((start, size))
        start += size
    return pieces


def _packed_linear_pieces(x: torch.Tensor, rows: int, packed: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] with more than MAX_PACKED_ROWS rows through the packed weight, a piece at a
    time (`row_pieces`; the last one zero-padded)."""
    flat = x.reshape(rows, x.shape[-1])
    pieces = row_pieces(rows)
    out = None
    for start, size in pieces:
        part = flat[start:start + size]
        if part.shape[0] < size:
            part = F.pad(part, (0, 0, 0, size - part.shape[0]))
        y = _pointwise(part, packed, bias, "none", [], "")
        if len(pieces) == 1:
            out = y[:rows]
            break
        if out is None:
            out = y.new_empty(rows, y.shape[-1])
        n = min(size, rows - start)
        out[start:start + n] = y[:n]
    return out.view(*x.shape[:-1], out.shape[-1])


def _pointwise(*args):  # a seam for tests: every call that reaches oneDNN
    return torch.ops.mkldnn._linear_pointwise(*args)


def pack_linears(model: nn.Module) -> int:
    """Packs every `Linear` of `model` whose weight can be packed; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and packing_available(m.weight.dtype, m.weight.device):
            m.pack()
            n += 1
    return n


def unpack_linears(model: nn.Module) -> None:
    """Drops the packed copies (and a model's fused decode copies, `decode.py`, made from the
    same weights)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.unpack()
    if getattr(model, "fast_decode", None) is not None:
        model.fast_decode = None
