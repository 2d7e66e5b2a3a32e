"""The gated delta rule: a recurrent step form (also the reference) and a chunked form.

Shapes (fla convention): q, k: [B, T, H, K]; v: [B, T, H, V]; g (log decay, <= 0) and beta:
[B, T, H]; state: [B, H, K, V] in fp32. q and k are expected L2-normalised and already
expanded to the value heads. Per token t the state is updated as

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale * q_t)

Positions with g = 0 and beta = 0 leave the state untouched, so sequences of a batch may be
right-padded with such positions and their final states stay exact.
"""

from __future__ import annotations

import torch


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 without an operator call when it already is (decode runs ~30 such per step)."""
    return x if x.dtype == torch.float32 else x.float()


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form: the definition, used for decode and as the test oracle."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        k_t = k[:, t]  # [B, H, K]
        kv = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # [B, H, V]
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2) * scale)
    return torch.stack(outs, dim=1).to(out_dtype), S


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token (T = 1) with batched matmuls; same maths as the recurrent form."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v = _f32(q[:, 0]), _f32(k[:, 0]), _f32(v[:, 0])  # [B, H, *]
    S = q.new_zeros(B, H, K, V) if initial_state is None else _f32(initial_state)
    S = S * _f32(g[:, 0]).exp().view(B, H, 1, 1)
    k = k.reshape(B * H, K, 1)  # q, k, v may be strided views of the projections
    kv = torch.bmm(k.transpose(1, 2), S.view(B * H, K, V))  # [B * H, 1, V]
    delta = (v.reshape(B * H, 1, V) - kv) * _f32(beta[:, 0]).reshape(B * H, 1, 1)
    S = torch.baddbmm(S.view(B * H, K, V), k, delta).view(B, H, K, V)
    o = torch.bmm(q.reshape(B * H, 1, K), S.view(B * H, K, V)).view(B, 1, H, V) * scale
    return (o if o.dtype == out_dtype else o.to(out_dtype)), S


def chunk_size_for(T: int, chunk_size: int, states_at) -> int:
    """The chunk a forward of T tokens runs in: a forward shorter than the chunk (a replay of
    a few anchors, a short suffix) runs as one chunk of the next power of two (>= 8), not T
    padded to the chunk size, which would cost a full chunk's matrices; snapshots keep the
    chunk size (their offsets are its multiples)."""
    if states_at is None and T < chunk_size:
        return max(8, 1 << (T - 1).bit_length())
    return chunk_size


class ChunkSnapshots:
    """The carried state after chunk-aligned offsets, recorded as a chunked scan runs:
    `states_at` = (rows [M], offsets [M], multiples of C); `out` [M, *state] once done."""

    def __init__(self, states_at: tuple[torch.Tensor, torch.Tensor], C: int, num_chunks: int,
                 state: torch.Tensor) -> None:
        self.rows, self.chunk = states_at[0], states_at[1] // C - 1
        bad = (states_at[1] % C != 0) | (self.chunk < 0) | (self.chunk >= num_chunks)
        if bool(bad.any()):
            raise ValueError(f"snapshot offsets must be multiples of {C} within the forward")
        self.out = state.new_empty(self.rows.numel(), *state.shape[1:])
        self.wanted = set(self.chunk.tolist())

    def record(self, n: int, state: torch.Tensor) -> None:
        """`state` [B, ...] is the state after chunk n."""
        if n in self.wanted:
            hit = (self.chunk == n).nonzero().view(-1)
            self.out[hit] = state[self.rows[hit]]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    output: bool = True,
    states_at: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Chunked (parallel within a chunk, sequential across chunks) form; differentiable.

    Within a chunk the T sequential rank-one updates are folded into one lower-triangular
    solve (the WY / UT transform), then the chunk reads and writes the carried state once.
    output=False returns (None, final state) and skips the outputs' work (suffix replay's
    last layer of a group needs only its state). With `states_at` = (rows [M], offsets [M],
    multiples of `chunk_size`) a third result: the state [M, H, K, V] after the first
    `offset` tokens of each `row`, the carried state between chunks (mid-forward snapshots).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size_for(T, chunk_size, states_at)
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    # [B, H, T, *] in fp32
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    pad = (-T) % C
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    q = q.reshape(B, H, N, C, K) * scale
    k = k.reshape(B, H, N, C, K)
    v = v.reshape(B, H, N, C, V)
    beta = beta.reshape(B, H, N, C, 1)
    gc = g.reshape(B, H, N, C).cumsum(-1)  # log decay from chunk start to each position

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta
    # Strictly lower part of (beta k k^T) * decay couples each update to the earlier ones.
    coupling = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = coupling + torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat((v * beta, k_beta * gc.exp().unsqueeze(-1)), dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :V], sol[..., V:]  # u: new values; w: how much each reads the old state

    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    if output:
        intra = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C], causal incl. diagonal
        q_decayed = q * gc.exp().unsqueeze(-1)

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    zero = initial_state is None  # the first chunk reads nothing from the state
    outs = []
    snaps = None if states_at is None else ChunkSnapshots(states_at, C, N, S)
    for n in range(N):
        first = zero and n == 0
        v_new = u[:, :, n] if first else u[:, :, n] - w[:, :, n] @ S
        if output:
            o_n = intra[:, :, n] @ v_new
            outs.append(o_n if first else o_n + q_decayed[:, :, n] @ S)
        S = S * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ v_new
        if snaps is not None:
            snaps.record(n, S)
    o = None
    if output:
        o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T]
        o = o.transpose(1, 2).to(out_dtype)
    return (o, S) if snaps is None else (o, S, snaps.out)
