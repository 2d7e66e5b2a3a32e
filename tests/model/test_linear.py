"""The oneDNN-packed CPU linear layer against F.linear (backend/model/linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.model import linear as linear_mod
from backend.model import load_model
from backend.model.linear import (
    MAX_CHUNK_ROWS,
    MAX_PACKED_ROWS,
    MIN_MACS,
    ROW_ALIGN,
    Linear,
    pack_linears,
    packing_available,
    row_pieces,
    unpack_linears,
)
from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO

pytestmark = pytest.mark.skipif(not packing_available(torch.float32),
                                reason="oneDNN not available in this torch build")


@pytest.fixture
def tiny_model_dir():
    return MODEL_REPO / DEFAULT_MODEL


def _packed(in_f: int, out_f: int, bias: bool, dtype=torch.float32, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(in_f, out_f, bias=bias).to(dtype)
    lin.pack()
    return lin


@pytest.mark.parametrize("shape", [(1, 1024), (8, 1024), (3, 5, 1024), (64, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(shape, bias):
    lin = _packed(1024, 1536, bias)
    x = torch.randn(*shape)
    assert x.numel() * lin.out_features >= MIN_MACS  # the packed path runs
    with torch.inference_mode():
        y = lin(x)
    ref = F.linear(x, lin.weight, lin.bias)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    # The packed copy is what ran: a packed copy of other weights gives other outputs.
    lin._packed = _packed(1024, 1536, bias, seed=1)._packed
    with torch.inference_mode():
        assert not torch.allclose(lin(x), ref, atol=1e-2)


needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="this CPU has no oneDNN bf16 path (AVX512-BF16 / "
                                       "AVX-NE-CONVERT): bf16 weights stay unpacked here")


@needs_bf16
def test_bf16_packed():
    lin = _packed(512, 2048, False, torch.bfloat16)
    x = torch.randn(8, 512, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
    ref = F.linear(x.float(), lin.weight.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=0.5)


def test_plain_path_when_training_or_weight_replaced():
    lin = _packed(1024, 1024, False)
    x = torch.randn(4, 1024, requires_grad=True)
    y = lin(x)  # autograd on: F.linear, so gradients flow
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    # A new parameter in place of the packed one: the stale packed copy is not used.
    lin.weight = torch.nn.Parameter(torch.randn(1024, 1024))
    with torch.inference_mode():
        torch.testing.assert_close(lin(x.detach()), F.linear(x.detach(), lin.weight))
    unpack_linears(lin)
    assert lin._packed is None


def test_load_model_packs_and_matches_unpacked(tiny_model_dir):
    packed = load_model(tiny_model_dir)
    plain = load_model(tiny_model_dir, pack=False)
    n = sum(1 for m in packed.modules() if isinstance(m, Linear) and m._packed is not None)
    assert n == sum(1 for m in packed.modules() if isinstance(m, Linear)) > 0
    assert all(m._packed is None for m in plain.modules() if isinstance(m, Linear))
    ids = torch.randint(0, 256, (2, 300))
    with torch.inference_mode():
        torch.testing.assert_close(packed.logits(ids), plain.logits(ids), rtol=1e-4, atol=1e-4)
    # Parameters stay the checkpoint's (state dicts, export and engines see them).
    for (na, a), (nb, b) in zip(packed.state_dict().items(), plain.state_dict().items()):
        assert na == nb and torch.equal(a, b)


def test_env_turns_packing_off(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("SUFFIXREPLAY_PACKED_LINEAR", "0")
    model = load_model(tiny_model_dir)
    assert all(m._packed is None for m in model.modules() if isinstance(m, Linear))
    assert pack_linears(model) == 0


def test_onednn_sees_few_row_counts(monkeypatch):
    """oneDNN keeps one primitive (and its memory) per input shape: whatever the number of
    rows, what reaches it is a power of two up to MAX_CHUNK_ROWS (small inputs padded, larger
    ones cut into pieces). Results equal F.linear either way."""
    seen = []

    def spy(*args):
        seen.append(args[0].shape[0])
        return torch.ops.mkldnn._linear_pointwise(*args)

    monkeypatch.setattr(linear_mod, "_pointwise", spy)
    lin = _packed(512, 512, True)
    for rows in [*range(1, 3 * MAX_PACKED_ROWS), 300, 1000, 1024, 1500, 2 * MAX_CHUNK_ROWS + 65]:
        x = torch.randn(rows, 512)
        with torch.inference_mode():
            y = lin(x)
        ref = F.linear(x, lin.weight, lin.bias)
        assert y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    powers = {1 << i for i in range(MAX_CHUNK_ROWS.bit_length())}
    assert set(seen) <= powers and max(seen) == MAX_CHUNK_ROWS
    assert len(set(seen)) == len(powers)  # every power of two up to the largest piece


def test_row_pieces_cover_the_rows_in_few_sizes():
    for rows in range(MAX_PACKED_ROWS + 1, 3 * MAX_CHUNK_ROWS, 37):
        pieces = row_pieces(rows)
        assert pieces[0][0] == 0
        for (s0, n0), (s1, _) in zip(pieces, pieces[1:]):
            assert s1 == s0 + n0 and n0 >= pieces[-1][1]  # contiguous, largest first
        end = pieces[-1][0] + pieces[-1][1]
        assert rows <= end < rows + ROW_ALIGN  # padding less than one alignment unit
        for _, n in pieces:
            assert n % ROW_ALIGN == 0 and n & (n - 1) == 0 and n <= MAX_CHUNK_ROWS


@needs_bf16
def test_pieces_keep_leading_dims_and_bf16():
    lin = _packed(256, 768, False, torch.bfloat16)
    x = torch.randn(3, 700, 256, dtype=torch.bfloat16)  # 2100 rows: 1024 + 1024 + 64 (padded)
    with torch.inference_mode():
        y = lin(x)
    ref = F.linear(x.float(), lin.weight.float())
    assert y.shape == (3, 700, 768)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=0.5)


def test_bf16_is_packed_only_where_the_cpu_has_its_path():
    from backend.model.linear import packing_available

    assert packing_available(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
