"""The chunked Mamba2 scan against its recurrent definition."""

from __future__ import annotations

import pytest
import torch

from backend.model.mamba_scan import chunk_ssd, recurrent_ssd


def _inputs(B, T, H, N, P, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, N, generator=g)
    k = torch.randn(B, T, H, N, generator=g)
    v = torch.randn(B, T, H, P, generator=g)
    gate = -torch.rand(B, T, H, generator=g) * 0.5  # log decay <= 0
    s0 = torch.randn(B, H, N, P, generator=g)
    return q, k, v, gate, s0


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (20, 64), (64, 64), (150, 64), (37, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, chunk, with_state):
    q, k, v, g, s0 = _inputs(2, T, 3, 8, 5)
    s0 = s0 if with_state else None
    want_o, want_s = recurrent_ssd(q, k, v, g, s0)
    o, s = chunk_ssd(q, k, v, g, s0, chunk_size=chunk)
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)
    none, s_only = chunk_ssd(q, k, v, g, s0, chunk_size=chunk, output=False)
    assert none is None
    torch.testing.assert_close(s_only, want_s, atol=1e-4, rtol=1e-4)


def test_snapshots_are_the_states_after_their_offsets():
    q, k, v, g, s0 = _inputs(2, 150, 2, 4, 3, seed=3)
    rows, offsets = torch.tensor([0, 1, 1]), torch.tensor([64, 64, 128])
    _, _, snaps = chunk_ssd(q, k, v, g, s0, chunk_size=64, states_at=(rows, offsets))
    for i, (r, n) in enumerate(zip(rows.tolist(), offsets.tolist())):
        _, want = recurrent_ssd(q[r:r + 1, :n], k[r:r + 1, :n], v[r:r + 1, :n], g[r:r + 1, :n],
                                s0[r:r + 1])
        torch.testing.assert_close(snaps[i], want[0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="multiples of 64"):
        chunk_ssd(q, k, v, g, s0, states_at=(rows, torch.tensor([64, 60, 128])))


def test_padding_positions_leave_the_state_untouched():
    q, k, v, g, s0 = _inputs(1, 40, 2, 4, 3, seed=5)
    g[:, 25:] = 0
    v[:, 25:] = 0
    _, padded = chunk_ssd(q, k, v, g, s0)
    _, short = recurrent_ssd(q[:, :25], k[:, :25], v[:, :25], g[:, :25], s0)
    torch.testing.assert_close(padded, short, atol=1e-5, rtol=1e-5)
