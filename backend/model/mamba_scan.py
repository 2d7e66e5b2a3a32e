"""The Mamba2 state-space scan (SSD, state-space duality): a recurrent form (the
reference) and a chunked form.

Written as decayed linear attention, in the layout of `delta_rule.py`: q = C, k = B (both
already expanded from their groups to the heads), v = dt * x, g = dt * A (log decay, <= 0):

    S <- S * exp(g_t) + k_t v_t^T;  o_t = S^T q_t          (S: [H, N, P] per sequence, fp32)

(the D skip connection and the gate are the mixer's, `mamba2.py`). Shapes: q, k [B, T, H, N];
v [B, T, H, P]; g [B, T, H]; state [B, H, N, P]. A position with g = 0 and v = 0 leaves the
state untouched, so right-padded rows keep exact final states.
"""

from __future__ import annotations

import torch

from backend.model.delta_rule import ChunkSnapshots, chunk_size_for


def recurrent_ssd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: the definition (the test oracle; one-token decode steps)."""
    B, T, H, N = q.shape
    out_dtype = v.dtype
    q, k, v, g = (x.float() for x in (q, k, v, g))
    S = q.new_zeros(B, H, N, v.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None] + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(outs, dim=1).to(out_dtype), S


def chunk_ssd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    output: bool = True,
    states_at: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Chunked form: within a chunk the outputs are one masked, decayed q k^T product; the
    state is read and written once a chunk. output=False returns (None, final state). With
    `states_at` = (rows [M], offsets [M], multiples of `chunk_size`) a third result: the
    states [M, H, N, P] after the first `offset` tokens of each row (mid-forward snapshots).
    """
    B, T, H, N = q.shape
    P = v.shape[-1]
    C = chunk_size_for(T, chunk_size, states_at)
    out_dtype = v.dtype
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [B, H, T, *]
    g = g.transpose(1, 2).float()
    pad = (-T) % C
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = torch.nn.functional.pad(g, (0, pad))
    NC = (T + pad) // C
    q, k = q.reshape(B, H, NC, C, N), k.reshape(B, H, NC, C, N)
    v = v.reshape(B, H, NC, C, P)
    gc = g.reshape(B, H, NC, C).cumsum(-1)  # log decay from the chunk's start
    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [B, H, NC, 1, 1]
    if output:
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
        intra = ((q @ k.transpose(-1, -2)) * decay) @ v  # [B, H, NC, C, P]
        q_decayed = q * gc.exp().unsqueeze(-1)
    S = q.new_zeros(B, H, N, P) if initial_state is None else initial_state.float()
    outs = []
    snaps = None if states_at is None else ChunkSnapshots(states_at, C, NC, S)
    for n in range(NC):
        if output:
            outs.append(intra[:, :, n] + q_decayed[:, :, n] @ S)
        S = S * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ v[:, :, n]
        if snaps is not None:
            snaps.record(n, S)
    o = None
    if output:
        o = torch.stack(outs, dim=2).reshape(B, H, NC * C, P)[:, :, :T]
        o = o.transpose(1, 2).to(out_dtype)
    return (o, S) if snaps is None else (o, S, snaps.out)
