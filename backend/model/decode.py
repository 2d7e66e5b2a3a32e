"""The CPU fast path for decode steps (one new token a sequence, or a few): fused weights, few
calls (every family: Qwen3.5 / Qwen3-Next decoder layers, Nemotron-H's Mamba2 / attention / MLP
blocks; mixture-of-experts MLPs run their own code inside the step).

A decode step of a small model on the CPU is bound by the number of operator calls, not by
arithmetic: the general layer code (`hybrid.py`, written for any number of tokens and for
autograd) makes ~80 calls per Gated DeltaNet layer through a dozen module calls, ~7 ms a step
for the default 8-layer model where its 47 products take ~2 ms. For steps where every
sequence adds exactly one token this module runs each layer as one straight function over
[B, D] rows with:
- the projections that read the same input fused into one oneDNN-packed product: a Gated
  DeltaNet layer's qkv, z, b and a; an attention layer's q (with its gate), k and v; the
  MLP's gate and up (a snapshot of the weights concatenated, like `linear.py`'s packing);
  a Mamba2 mixer's in_proj is one product already;
- constants computed once: each RMSNorm's (1 + w), the decay's -exp(A_log), the conv taps;
- the conv step as one multiply-add over the [B, C, W] window, q and k normalised and
  expanded together, rotary applied to q and k heads in one pass.
The arithmetic is the general path's (same operations in the same precision; sums may
associate differently, within fp32 rounding: `tests/model/test_decode.py` holds it to the
general path and the oracle tests to transformers).

Steps of a few tokens a row (up to MAX_FAST_TOKENS: speculative verification, jump-forward
chunks, short suffixes) run the same fused layers over all B * T rows (`multi`), padded rows
masked, the conv as one windowed sum and the recurrences a token at a time (the decode
step's arithmetic, T times); with a `StateLog` on the batch, what the recurrences read is
kept, so a row's states after fewer of its tokens can be rebuilt afterwards (`rewind`).

Rows on LoRA adapters take this path too: each product (`_Product`) adds, per part, the
low-rank terms of the rows on that part's adapters (`lora.delta`, read from the layers at
call time), as `Linear.forward` does on the general path.

Used by `HybridForCausalLM.forward_batch` when the model was loaded for CPU inference in
float32 with packed linears (`load_model`), the step is one over cached sequences (at most
MAX_FAST_TOKENS tokens a row, no fresh row, no mid-forward snapshots). Anchor capture and
the tiered KV's layer hooks are honoured. A weight replaced or edited in place after the
snapshot (its `_version` moves) is seen: that layer's fused copy is rebuilt before use.
Set SUFFIXREPLAY_FAST_DECODE=0 to turn the path off (e.g. to compare against it).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from backend.model import lora
from backend.model.linear import packing_available
from backend.model.mlp import NemotronMoE, SparseMoE
from backend.model.rotary import apply_rotary


def fused_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Concatenated weights of the projections of a decoder layer that read one input (the
    MLP's gate and up; a Gated DeltaNet's qkv, z, b, a; attention's q, k, v and their
    biases): one product each. Shared with the compiled step graphs (`packed.py`)."""
    def cat(*ts):
        return torch.cat([t.detach() for t in ts])

    out = {}
    if not isinstance(layer.mlp, SparseMoE):  # a routed MLP has nothing to fuse
        out["gate_up"] = cat(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight)
    if layer.is_linear:
        m = layer.linear_attn
        out["in"] = cat(m.in_proj_qkv.weight, m.in_proj_z.weight, m.in_proj_b.weight,
                        m.in_proj_a.weight)
    else:
        at = layer.self_attn
        out["qkv"] = cat(at.q_proj.weight, at.k_proj.weight, at.v_proj.weight)
        if at.q_proj.bias is not None:
            out["qkv_bias"] = cat(at.q_proj.bias, at.k_proj.bias, at.v_proj.bias)
    return out


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def _packed_of(linear: nn.Module) -> torch.Tensor:
    """A single product's packed weight: the `Linear`'s own copy (packed again if stale), so
    the unfused products cost no memory here."""
    if linear._packed is None or linear._packed_from is not linear.weight \
            or linear._packed_version != linear.weight._version:
        linear.pack()
    return linear._packed


class _Product:
    """One packed product over one input: a `Linear`'s own, or several fused (their outputs
    concatenated in order); the LoRA terms of the batch's adapter rows are added to each
    part's output (`lora.delta`), read from the layers at call time."""

    def __init__(self, linears: list[nn.Module], packed: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        self.linears = linears
        if packed is None:  # a single product: the layer's own packed copy and bias
            (linear,) = linears
            packed, bias = _packed_of(linear), _bias(linear)
        self.packed, self.bias = packed, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, K] -> [N, sum of the parts' outputs]."""
        y = _mm(x, self.packed, self.bias)
        if lora.any_active():
            start = 0
            for linear in self.linears:
                end = start + linear.out_features
                if linear.lora is not None:
                    d = lora.delta(linear.lora, x)
                    if d is not None:
                        y[:, start:end] += d
                start = end
        return y


def _bias(linear: nn.Module) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, K] through a packed weight; B is padded to a power of two (few oneDNN
    primitives, as in `linear.py`)."""
    rows = x.shape[0]
    bucket = 1 << (rows - 1).bit_length()
    if bucket != rows:
        x = F.pad(x, (0, 0, 0, bucket - rows))
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Steps of up to this many tokens a row (speculative verification, jump-forward chunks, short
# suffixes) take the fused path too, the recurrence a token at a time (`multi`); longer ones
# the chunked general path.
MAX_FAST_TOKENS = 16


class _Steps(NamedTuple):
    """A multi-token step's padding: keep [B, T] (None: no row padded), lengths [B]."""

    keep: torch.Tensor | None
    lengths: torch.Tensor


def _conv_steps(conv_state: torch.Tensor, xin: torch.Tensor, taps: torch.Tensor,
                bias: torch.Tensor | None, steps: _Steps):
    """The causal conv over T new inputs xin [B, T, C] after conv_state [B, C, W - 1]: the
    outputs before the activation [B, T, C], each row's new state (the last W - 1 inputs up
    to its length) and the inputs, state first, [B, C, W - 1 + T]."""
    B, T, C = xin.shape
    W = taps.shape[1]
    full = torch.cat((conv_state, xin.transpose(1, 2)), -1)  # [B, C, W - 1 + T]
    mixed = (full.unfold(-1, W, 1) * taps.unsqueeze(1)).sum(-1)  # [B, C, T]
    if bias is not None:
        mixed = mixed + bias.unsqueeze(-1)
    new = full[:, :, T:] if steps.keep is None else _conv_state_at(full, steps.lengths, W - 1)
    return mixed.transpose(1, 2), new, full


def _conv_state_at(full: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state (the last `width` inputs) after each row's first counts[b] new inputs,
    from its inputs `full` [B, C, width + T] (state first)."""
    B, C, _ = full.shape
    at = counts.view(B, 1, 1) + torch.arange(width, device=full.device).view(1, 1, -1)
    return full.gather(-1, at.expand(B, C, width))


def _delta_step(S: torch.Tensor, decay: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                beta: torch.Tensor) -> None:
    """One token of the gated delta rule on S [BH, K, V], in place: decay, beta [BH, 1, 1],
    k [BH, 1, K], v [BH, 1, V] (decode, multi-token steps and their rewinds alike)."""
    S.mul_(decay)
    delta = (v - torch.bmm(k, S)) * beta
    S.baddbmm_(k.transpose(1, 2), delta)


def _ssd_step(S: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, xdt: torch.Tensor) -> None:
    """One token of Mamba2's recurrence on S [B, H, N, P], in place: decay [B, H, 1, 1],
    b [B, H, N], xdt (x dt) [B, H, P]."""
    S.mul_(decay)
    S.add_(b.unsqueeze(-1) * xdt.unsqueeze(-2))


def _upto(counts: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] bool: token t is among row b's first counts[b]."""
    return torch.arange(T, device=counts.device).unsqueeze(0) < counts.unsqueeze(1)


def _rewind_delta_rule(S: torch.Tensor, terms: list[torch.Tensor], counts: torch.Tensor):
    """S [R, H, K, V] (updated in place) through each row's first counts tokens of the
    gated delta rule's terms decay, beta [R, H, T], k [R, H, T, K], v [R, H, T, V]."""
    decay, beta, k, v = terms
    R, H, T, K = k.shape
    upto = _upto(counts, T).unsqueeze(1)  # [R, 1, T]
    decay = decay.masked_fill(~upto, 1.0).reshape(R * H, T, 1)
    beta = (beta * upto).reshape(R * H, T, 1)
    k, v = k.reshape(R * H, T, K), v.reshape(R * H, T, -1)
    S = S.view(R * H, K, -1)
    for t in range(int(counts.max())):
        _delta_step(S, decay[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta[:, t:t + 1])


def _rewind_ssd(S: torch.Tensor, terms: list[torch.Tensor], counts: torch.Tensor):
    """S [R, H, N, P] (updated in place) through each row's first counts tokens of Mamba2's
    terms decay [R, T, H], b [R, T, H, N], xdt [R, T, H, P]."""
    decay, b, xdt = terms
    R, T, H = decay.shape
    upto = _upto(counts, T).unsqueeze(-1)  # [R, T, 1]
    decay = decay.masked_fill(~upto, 1.0)
    xdt = xdt * upto.unsqueeze(-1)
    for t in range(int(counts.max())):
        _ssd_step(S, decay[:, t].view(R, H, 1, 1), b[:, t], xdt[:, t])


class StateLog:
    """What a multi-token step's recurrences read, layer by layer (`multi` records it when
    the batch carries one): each linear layer's conv inputs and the recurrence's per-token
    terms. `rewind` rebuilds a row's states after any number of its new tokens from the
    states it had before the step, the recurrence alone (no product, no other layer): the
    exact arithmetic the step ran, stopped earlier. Speculative decoding keeps a rejected
    draft's states this way without computing the tokens it kept again."""

    def __init__(self) -> None:
        self.layers: list[tuple] = []  # (state index, "gdn" | "ssd", (conv inputs, terms...))

    def rewind(self, states, before, rows: torch.Tensor, slots: torch.Tensor,
               counts: torch.Tensor) -> None:
        """Rows `rows` of the step (run slots `slots`, whose states before the step are in
        `before` at the same slots) get in `states` the states after their first `counts`
        new tokens."""
        for index, kind, terms in self.layers:
            full = terms[0].index_select(0, rows)
            conv = _conv_state_at(full, counts, before.conv[index].shape[-1])
            rec = before.rec[index].index_select(0, slots).clone()
            if kind == "gdn":
                _rewind_delta_rule(rec, [t.index_select(0, rows) for t in terms[1:]], counts)
            else:
                _rewind_ssd(rec, [t.index_select(0, rows) for t in terms[1:]], counts)
            states.scatter(index, slots, conv, rec)


class _Fused:
    """The parameters a layer's fused copies were made from, with their versions (to notice
    replacement or in-place edits)."""

    def __init__(self, layer: nn.Module) -> None:
        self.sources = [(mod._parameters, name, p, p._version) for mod in layer.modules()
                        for name, p in mod._parameters.items() if p is not None]

    def current(self) -> bool:
        """The parameters are the ones copied, unedited."""
        return all(params[name] is p and p._version == v for params, name, p, v in self.sources)


class _FusedLayer(_Fused):
    """What every Qwen3.5 decoder layer has: the two norms and the MLP."""

    def __init__(self, layer: nn.Module, fused: dict[str, torch.Tensor]) -> None:
        super().__init__(layer)
        self.eps = layer.input_layernorm.eps
        self.n_in = (1.0 + layer.input_layernorm.weight).detach()
        self.n_post = (1.0 + layer.post_attention_layernorm.weight).detach()
        mlp = layer.mlp
        self.moe = mlp if isinstance(mlp, SparseMoE) else None  # Qwen3-Next: its own code
        if self.moe is None:
            self.gate_up = _Product([mlp.gate_proj, mlp.up_proj], _pack(fused["gate_up"]))
            self.ffn_dim = mlp.gate_proj.out_features
            self.down = _Product([mlp.down_proj])

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.n_post, self.eps)
        if self.moe is not None:
            return x + self.moe(h)
        gate, up = self.gate_up(h).split(self.ffn_dim, -1)
        return x + self.down(F.silu(gate) * up)


class _LinearLayer(_FusedLayer):
    """A decoder layer with a Gated DeltaNet mixer."""

    def __init__(self, layer: nn.Module) -> None:
        fused = fused_weights(layer)
        super().__init__(layer, fused)
        m = layer.linear_attn
        self.state_index = layer.state_index
        self.proj_in = _Product([m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a],
                                _pack(fused["in"]))
        self.in_sizes = [m.conv_dim, m.value_dim, m.num_v_heads, m.num_v_heads]
        self.taps = m.conv1d.weight.detach().squeeze(1)  # [C, W]
        self.neg_a = -m.A_log.detach().float().exp()
        self.dt_bias = m.dt_bias.detach()
        self.g_norm, self.g_eps = m.norm.weight.detach(), m.norm.eps
        self.proj_out = _Product([m.out_proj])
        self.hk, self.hv = m.num_k_heads, m.num_v_heads
        self.dk, self.dv = m.head_k_dim, m.head_v_dim
        self.qk_sizes = [2 * m.key_dim, m.value_dim]
        self.scale = m.head_k_dim ** -0.5

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor, rec: torch.Tensor):
        """x [B, D]; conv_state [B, C, W - 1]; rec [B, Hv, K, V] (updated in place: the
        caller's gathered copy) -> (x, conv, rec)."""
        B, D = x.shape
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        h = F.rms_norm(x, (D,), self.n_in, self.eps)
        xin, z, b, a = self.proj_in(h).split(self.in_sizes, -1)
        window = torch.cat((conv_state.to(x.dtype), xin.unsqueeze(-1)), -1)  # [B, C, W]
        mixed = F.silu((window * self.taps).sum(-1))
        qk, v = mixed.split(self.qk_sizes, -1)
        qk = qk.reshape(B, 2 * hk, dk)  # q heads then k heads, normalised together
        qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
        if hv != hk:  # each key head serves hv / hk value heads (repeat_interleave's order)
            qk = qk.view(B, 2 * hk, 1, dk).expand(B, 2 * hk, hv // hk, dk).reshape(B, 2 * hv, dk)
        BH = B * hv
        decay = (self.neg_a * F.softplus(a + self.dt_bias)).exp()
        S = rec.view(BH, dk, dv)  # rec: this step's copy, updated in place
        _delta_step(S, decay.view(BH, 1, 1), qk[:, hv:].reshape(BH, 1, dk),
                    v.reshape(BH, 1, dv), b.sigmoid().reshape(BH, 1, 1))
        o = torch.bmm(qk[:, :hv].reshape(BH, 1, dk), S).view(B, hv, dv) * self.scale
        y = F.rms_norm(o, (dv,), self.g_norm, self.g_eps) * F.silu(z.view(B, hv, dv))
        x = x + self.proj_out(y.view(B, hv * dv))
        return self.ffn(x), window[:, :, 1:], S.view(B, hv, dk, dv)

    def multi(self, x: torch.Tensor, conv_state: torch.Tensor, rec: torch.Tensor,
              steps: _Steps, log: StateLog | None = None):
        """`__call__` over T tokens a row (x [B, T, D]): the products over all B * T rows
        at once, the conv as one windowed sum, the recurrence a token at a time (the decode
        step's arithmetic, T times); a row's padding leaves its states as they were. With
        `log`, what the recurrences read is recorded there."""
        B, T, D = x.shape
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        h = F.rms_norm(x, (D,), self.n_in, self.eps)
        xin, z, b, a = self.proj_in(h.view(B * T, D)).split(self.in_sizes, -1)
        mixed, new_conv, full = _conv_steps(conv_state.to(x.dtype), xin.view(B, T, -1),
                                            self.taps, None, steps)
        qk, v = F.silu(mixed).split(self.qk_sizes, -1)
        qk = qk.reshape(B, T, 2 * hk, dk)
        qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
        if hv != hk:
            qk = qk.view(B, T, 2 * hk, 1, dk).expand(B, T, 2 * hk, hv // hk, dk)
            qk = qk.reshape(B, T, 2 * hv, dk)
        decay = (self.neg_a * F.softplus(a + self.dt_bias)).exp().view(B, T, hv)
        beta = b.sigmoid().view(B, T, hv)
        if steps.keep is not None:  # padding: no decay, no update
            decay = decay.masked_fill(~steps.keep.unsqueeze(-1), 1.0)
            beta = beta * steps.keep.unsqueeze(-1)
        BH = B * hv
        S = rec.view(BH, dk, dv)  # rec: this step's copy, updated in place
        q = qk[:, :, :hv].transpose(1, 2).reshape(BH, T, dk)
        k = qk[:, :, hv:].transpose(1, 2).reshape(BH, T, dk)
        v = v.reshape(B, T, hv, dv).transpose(1, 2).reshape(BH, T, dv)
        decay = decay.transpose(1, 2).reshape(BH, T, 1)
        beta = beta.transpose(1, 2).reshape(BH, T, 1)
        if log is not None:
            log.layers.append((self.state_index, "gdn", (
                full, decay.view(B, hv, T), beta.view(B, hv, T), k.view(B, hv, T, dk),
                v.view(B, hv, T, dv))))
        outs = []
        for t in range(T):
            _delta_step(S, decay[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta[:, t:t + 1])
            outs.append(torch.bmm(q[:, t:t + 1], S))
        o = torch.cat(outs, 1).view(B, hv, T, dv).transpose(1, 2) * self.scale
        y = F.rms_norm(o, (dv,), self.g_norm, self.g_eps) * F.silu(z.view(B, T, hv, dv))
        x = x + self.proj_out(y.reshape(B * T, hv * dv)).view(B, T, D)
        return self.ffn(x.view(B * T, D)).view(B, T, D), new_conv, S.view(B, hv, dk, dv)


class _AttentionLayer(_FusedLayer):
    """A decoder layer with full attention over paged KV."""

    def __init__(self, layer: nn.Module) -> None:
        fused = fused_weights(layer)
        super().__init__(layer, fused)
        at = self.attn = layer.self_attn
        self.h, self.hkv, self.dh = at.num_heads, at.num_kv_heads, at.head_dim
        self.qkv_sizes = [self.h * 2 * self.dh, self.hkv * self.dh, self.hkv * self.dh]
        self.qkv = _Product([at.q_proj, at.k_proj, at.v_proj], _pack(fused["qkv"]),
                            fused.get("qkv_bias"))
        self.o = _Product([at.o_proj])
        # q heads then k heads, each kind with its own (1 + w): one norm call for both
        self.qk_norm = torch.cat([(1.0 + at.q_norm.weight).detach().expand(self.h, -1),
                                  (1.0 + at.k_norm.weight).detach().expand(self.hkv, -1)])
        self.qk_eps = at.q_norm.eps

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch):
        """x [B, D]; cos, sin [B, 1, R] -> x."""
        B, D = x.shape
        h, hkv, dh = self.h, self.hkv, self.dh
        qg, k, v = self.qkv(F.rms_norm(x, (D,), self.n_in, self.eps)).split(self.qkv_sizes, -1)
        qg = qg.view(B, h, 2 * dh)
        qk = torch.cat((qg[..., :dh], k.view(B, hkv, dh)), 1)  # [B, H + Hkv, Dh]
        qk = F.rms_norm(qk, (dh,), None, self.qk_eps) * self.qk_norm
        qk = apply_rotary(qk, cos.view(B, -1), sin.view(B, -1))  # the rows as its tokens
        out = _attend(self.attn, batch, qk[:, :h], qk[:, h:], v.view(B, hkv, dh))
        out = out * torch.sigmoid(qg[..., dh:].reshape(B, h * dh))
        return self.ffn(x + self.o(out))

    def multi(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch):
        """`__call__` over T tokens a row: x [B, T, D]; cos, sin [B, T, R]."""
        B, T, D = x.shape
        N, h, hkv, dh = B * T, self.h, self.hkv, self.dh
        qg, k, v = self.qkv(F.rms_norm(x.view(N, D), (D,), self.n_in,
                                       self.eps)).split(self.qkv_sizes, -1)
        qg = qg.view(N, h, 2 * dh)
        qk = torch.cat((qg[..., :dh], k.view(N, hkv, dh)), 1)
        qk = F.rms_norm(qk, (dh,), None, self.qk_eps) * self.qk_norm
        qk = apply_rotary(qk, cos.reshape(N, -1), sin.reshape(N, -1))
        out = _attend(self.attn, batch, qk[:, :h], qk[:, h:], v.view(N, hkv, dh), T)
        out = out * torch.sigmoid(qg[..., dh:].reshape(N, h * dh))
        return self.ffn(x.view(N, D) + self.o(out)).view(B, T, D)


def _attend(attn: nn.Module, batch, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, T: int = 1) -> torch.Tensor:
    """Writes the step's k, v [B * T, Hkv, Dh] (T tokens a row; a padded row's padding is
    not written) into the paged KV (with the tiered store's layer hooks) and attends q
    [B * T, H, Dh] over each row's context -> [B * T, H * Dh]."""
    kv, a = batch.kv, attn.attn_index
    slots = batch.write_slots
    if T > 1:
        k, v = k.index_select(0, batch.write_rows), v.index_select(0, batch.write_rows)
    kv.k[a].index_copy_(0, slots, k)
    kv.v[a].index_copy_(0, slots, v)
    if batch.layer_hooks is not None:
        batch.layer_hooks.after_write(a)
        batch.layer_hooks.before_read(a)
    k_ctx, v_ctx = attn._context(kv, batch)  # [B, Ctx, Hkv, Dh]
    N, H, Dh = q.shape
    B = N // T
    out = F.scaled_dot_product_attention(
        q.view(B, T, H, Dh).transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
        attn_mask=None if B == 1 and T == 1 else batch.attn_mask,
        enable_gqa=True)  # [B, H, T, Dh]
    return out.transpose(1, 2).reshape(N, -1)


class _MambaBlock(_Fused):
    """A Nemotron-H block with a Mamba2 mixer: norm, in_proj, the conv step, the SSD step
    (S <- S exp(dt A) + B (dt x)^T, y = S^T C + D x), the gated group norm, out_proj."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        m = layer.mixer
        self.state_index = layer.state_index
        self.norm_w, self.eps = layer.norm.weight.detach(), layer.norm.eps
        self.proj_in = _Product([m.in_proj])
        self.in_sizes = [m.inner, m.conv_dim, m.num_heads]
        self.taps = m.conv1d.weight.detach().squeeze(1)  # [C, W]
        self.conv_bias = None if m.conv1d.bias is None else m.conv1d.bias.detach()
        self.h, self.p, self.g, self.n = m.num_heads, m.head_dim, m.n_groups, m.d_state
        self.xbc_sizes = [m.inner, m.n_groups * m.d_state, m.n_groups * m.d_state]
        self.neg_a = -m.A_log.detach().float().exp()
        self.dt_bias, self.dt_limit = m.dt_bias.detach(), (m.dt_lo, m.dt_hi)
        self.skip = m.D.detach().float().unsqueeze(-1)  # [H, 1]
        self.g_norm, self.g_eps, self.g_size = m.norm.weight.detach(), m.norm.eps, m.norm.group_size
        self.proj_out = _Product([m.out_proj])

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor, rec: torch.Tensor):
        """x [B, D]; conv_state [B, C, W - 1]; rec [B, H, N, P] (updated in place: the
        caller's gathered copy) -> (x, conv, rec)."""
        B, D = x.shape
        H, P, G, N = self.h, self.p, self.g, self.n
        z, xbc, dt = self.proj_in(F.rms_norm(x, (D,), self.norm_w,
                                             self.eps)).split(self.in_sizes, -1)
        window = torch.cat((conv_state.to(x.dtype), xbc.unsqueeze(-1)), -1)  # [B, C, W]
        mixed = (window * self.taps).sum(-1)
        if self.conv_bias is not None:
            mixed = mixed + self.conv_bias
        xs, b, c = F.silu(mixed).split(self.xbc_sizes, -1)
        dt = F.softplus(dt + self.dt_bias).clamp(*self.dt_limit)  # [B, H]
        bc = torch.stack((b, c), 1).view(B, 2, G, 1, N).expand(B, 2, G, H // G, N)
        bc = bc.reshape(B, 2, H, N)  # each group's B and C serve H / G heads
        xs = xs.view(B, H, P)
        S = rec  # this step's copy, updated in place
        _ssd_step(S, (dt * self.neg_a).exp().view(B, H, 1, 1), bc[:, 0], xs * dt.unsqueeze(-1))
        y = torch.matmul(bc[:, 1].unsqueeze(-2), S).squeeze(-2) + xs * self.skip  # [B, H, P]
        y = (y.view(B, H * P) * F.silu(z)).view(B, -1, self.g_size)
        y = F.rms_norm(y, (self.g_size,), None, self.g_eps).view(B, H * P) * self.g_norm
        return x + self.proj_out(y), window[:, :, 1:], S

    def multi(self, x: torch.Tensor, conv_state: torch.Tensor, rec: torch.Tensor,
              steps: _Steps, log: StateLog | None = None):
        """`__call__` over T tokens a row (x [B, T, D]), as `_LinearLayer.multi`."""
        B, T, D = x.shape
        M = B * T
        H, P, G, N = self.h, self.p, self.g, self.n
        z, xbc, dt = self.proj_in(F.rms_norm(x.view(M, D), (D,), self.norm_w,
                                             self.eps)).split(self.in_sizes, -1)
        mixed, new_conv, full = _conv_steps(conv_state.to(x.dtype), xbc.view(B, T, -1),
                                            self.taps, self.conv_bias, steps)
        xs, b, c = F.silu(mixed).split(self.xbc_sizes, -1)
        dt = F.softplus(dt.view(B, T, H) + self.dt_bias).clamp(*self.dt_limit)
        decay = (dt * self.neg_a).exp()
        if steps.keep is not None:  # padding: no decay, no update
            decay = decay.masked_fill(~steps.keep.unsqueeze(-1), 1.0)
            dt = dt * steps.keep.unsqueeze(-1)
        bc = torch.stack((b, c), 2).view(B, T, 2, G, 1, N).expand(B, T, 2, G, H // G, N)
        bc = bc.reshape(B, T, 2, H, N)
        xs = xs.reshape(B, T, H, P)
        xdt = xs * dt.unsqueeze(-1)
        if log is not None:
            log.layers.append((self.state_index, "ssd", (full, decay, bc[:, :, 0], xdt)))
        S = rec  # this step's copy, updated in place
        ys = []
        for t in range(T):
            _ssd_step(S, decay[:, t].view(B, H, 1, 1), bc[:, t, 0], xdt[:, t])
            ys.append(torch.matmul(bc[:, t, 1].unsqueeze(-2), S).squeeze(-2))
        y = torch.stack(ys, 1) + xs * self.skip  # [B, T, H, P]
        y = (y.reshape(M, H * P) * F.silu(z)).view(M, -1, self.g_size)
        y = F.rms_norm(y, (self.g_size,), None, self.g_eps).view(M, H * P) * self.g_norm
        return x + self.proj_out(y).view(B, T, D), new_conv, S


class _PlainAttentionBlock(_Fused):
    """A Nemotron-H attention block: norm, one q/k/v product, attention without positional
    encoding, o_proj."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        at = self.attn = layer.mixer
        self.norm_w, self.eps = layer.norm.weight.detach(), layer.norm.eps
        self.h, self.hkv, self.dh = at.num_heads, at.num_kv_heads, at.head_dim
        self.sizes = [self.h * self.dh, self.hkv * self.dh, self.hkv * self.dh]
        projs = [at.q_proj, at.k_proj, at.v_proj]
        self.qkv = _Product(projs, _pack(torch.cat([p.weight.detach() for p in projs])),
                            None if at.q_proj.bias is None else
                            torch.cat([_bias(p) for p in projs]))
        self.o = _Product([at.o_proj])

    def __call__(self, x: torch.Tensor, cos, sin, batch) -> torch.Tensor:
        B, D = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (D,), self.norm_w, self.eps)).split(self.sizes, -1)
        out = _attend(self.attn, batch, q.view(B, self.h, self.dh),
                      k.view(B, self.hkv, self.dh), v.view(B, self.hkv, self.dh))
        return x + self.o(out)

    def multi(self, x: torch.Tensor, cos, sin, batch) -> torch.Tensor:
        B, T, D = x.shape
        N = B * T
        q, k, v = self.qkv(F.rms_norm(x.view(N, D), (D,), self.norm_w,
                                      self.eps)).split(self.sizes, -1)
        out = _attend(self.attn, batch, q.view(N, self.h, self.dh),
                      k.view(N, self.hkv, self.dh), v.view(N, self.hkv, self.dh), T)
        return x + self.o(out).view(B, T, D)


class _MlpBlock(_Fused):
    """A Nemotron-H MLP block: norm, up, squared ReLU, down."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        mlp = layer.mixer
        self.norm_w, self.eps = layer.norm.weight.detach(), layer.norm.eps
        self.up, self.down = _Product([mlp.up_proj]), _Product([mlp.down_proj])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(F.rms_norm(x, (x.shape[-1],), self.norm_w, self.eps))
        return x + self.down(F.relu(h).square())


class _MoEBlock(_Fused):
    """A Nemotron-H mixture-of-experts block: its general code over the [B, D] rows (the
    routing decides per token which products run; nothing to fuse)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer.mixer(self.layer.norm(x))


class FastDecode:
    """Fused copies of a model's layers for one-token steps (see the module doc)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = [self._fuse(layer) for layer in model.model.layers]
        self.entry_to_group = {e: g for g, e in enumerate(model.config.group_entry_layers)}
        self.final_norm = model.model.norm
        # Qwen3.5's norms scale by (1 + w), Nemotron-H's by w.
        self._norm_offset = 0.0 if model.config.is_nemotron_h else 1.0
        self._final = None  # (weight, its version, offset + weight)

    @staticmethod
    def _fuse(layer: nn.Module) -> _Fused:
        if hasattr(layer, "mixer"):  # Nemotron-H
            if layer.is_linear:
                return _MambaBlock(layer)
            if layer.is_attention:
                return _PlainAttentionBlock(layer)
            return _MoEBlock(layer) if isinstance(layer.mixer, NemotronMoE) else _MlpBlock(layer)
        return _LinearLayer(layer) if layer.is_linear else _AttentionLayer(layer)

    @classmethod
    def available(cls, model: nn.Module) -> bool:
        """A float32 CPU model whose products can be packed, and not turned off by env."""
        return (model.dtype == torch.float32 and packing_available(model.dtype, model.device)
                and os.environ.get("SUFFIXREPLAY_FAST_DECODE", "1") != "0")

    @staticmethod
    def accepts(batch) -> bool:
        """A step over cached sequences of at most MAX_FAST_TOKENS tokens a row (a decode
        step: one each), KV and states given, no row starting fresh, no mid-forward
        snapshots."""
        return (batch.input_ids.shape[1] <= MAX_FAST_TOKENS and batch.kv is not None
                and batch.states is not None and batch.read_pages is not None
                and batch.fresh_rows is None and batch.snapshots is None
                and batch.input_ids.is_cpu)

    def run(self, batch) -> torch.Tensor:
        """The final-normed hidden states of the step's tokens: [B, D] for a decode step,
        [B, T, D] for T > 1 tokens a row (each layer's `multi`)."""
        model = self.model
        B, T = batch.input_ids.shape
        multi = T > 1
        x = model.model.embed_tokens(batch.input_ids if multi else batch.input_ids[:, 0])
        cos, sin = ((None, None) if model.rotary is None  # [B, T, R]
                    else model.rotary.cos_sin(batch.positions, x.dtype))
        steps = _Steps(batch.valid, batch.lengths) if multi else None
        slots, states, capture = batch.state_slots, batch.states, batch.capture
        for i, fused in enumerate(self.layers):
            if not fused.current():
                fused = self.layers[i] = self._fuse(model.model.layers[i])
            if capture is not None and i in self.entry_to_group:
                capture.write(self.entry_to_group[i], x)
            if isinstance(fused, (_LinearLayer, _MambaBlock)):
                j = fused.state_index
                conv = states.conv[j].index_select(0, slots)
                rec = states.rec[j].index_select(0, slots)
                x, conv, rec = (fused.multi(x, conv, rec, steps, batch.state_log) if multi
                                else fused(x, conv, rec))
                states.scatter(j, slots, conv, rec)
            elif isinstance(fused, (_MlpBlock, _MoEBlock)):
                x = fused(x.view(-1, x.shape[-1])).view(x.shape)
            else:
                x = fused.multi(x, cos, sin, batch) if multi else fused(x, cos, sin, batch)
        w = self.final_norm.weight
        if self._final is None or self._final[0] is not w or self._final[1] != w._version:
            self._final = (w, w._version, (self._norm_offset + w).detach())
        return F.rms_norm(x, (x.shape[-1],), self._final[2], self.final_norm.eps)
