"""The model over packed tokens, through the custom operators in `plugins/`: the form that
`engine_build/build.py --backend aot` exports and compiles, for every family (Qwen3.5's
Gated DeltaNet layers through `gated_delta_scan`, Nemotron-H's Mamba2 blocks through
`ssd_scan`; the routed experts of MoE layers through `moe_experts`, their routers in the
graph).

Everything here is a pure function of tensors (no Python branch on data), so `torch.export`
captures one graph with dynamic batch and token counts:
- `StepGraph`: one prefill or decode step of the engine. Tokens of all sequences are packed
  back to back ([N, D]); only attention scatters them into a padded [B, T] view to read the
  paged KV. It writes new KV into the page pools, new linear states into their slots and group
  entry hidden states into the anchor pools, all in place, and returns last-token logits.
- `ReplayGraph`: one group's linear layers (with MLPs) from zero state over packed anchors,
  returning each layer's final conv and recurrent states.

`packed_from_batch` turns the eager executor's inputs into StepGraph's, so the compiled and the
eager paths share one planner (`ForwardBatch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.batch import ForwardBatch
from backend.model.conv import causal_conv1d
from backend.model.decode import fused_weights
from backend.model.delta_rule import gated_delta_step
from backend.model.gated_deltanet import GatedDeltaNet
from backend.model.hybrid import DecoderLayer, HybridForCausalLM, NemotronHBlock
from backend.model.mamba2 import Mamba2Mixer
from backend.model.mamba_scan import recurrent_ssd
from backend.model.mlp import NemotronMoE, SparseMoE
from backend.model.rotary import apply_rotary


def linear_mixer_packed(mixer: GatedDeltaNet, x: torch.Tensor, cu_seqlens: torch.Tensor,
                        conv_state: torch.Tensor | None, rec_state: torch.Tensor | None,
                        decode: bool = False, output: bool = True,
                        snap_offsets: torch.Tensor | None = None,
                        w_in: torch.Tensor | None = None):
    """Gated DeltaNet over packed tokens x [N, D] -> (out [N, D], (conv, rec) per sequence).

    w_in: the qkv, z, b and a projections' weights concatenated (`fused_weights`): one
    product for the four.

    decode: one token per sequence (N = B); the conv and the delta-rule step are then plain
    tensor maths that the compiler fuses, instead of calls to the packed operators.
    output=False: (None, states), without the gated norm and the out projection.
    snap_offsets [B] (prefill only): a third result, the (conv, rec) states of each sequence
    after its first `snap_offsets[b]` tokens (multiples of 64; 0: none wanted, the values
    are then unspecified).
    """
    import plugins  # registers the operators

    weight = mixer.conv1d.weight.squeeze(1)
    z = None
    if w_in is None:
        xin = mixer.in_proj_qkv(x)
        beta, g = mixer.gates(x)
    else:
        Hv = mixer.num_v_heads
        xin, z, b, a = F.linear(x, w_in).split([mixer.conv_dim, mixer.value_dim, Hv, Hv], -1)
        beta, g = mixer.gates_of(b, a)
    if decode:
        mixed, new_conv = causal_conv1d(xin[:, None], weight, conv_state)
        mixed = mixed[:, 0]
    else:
        mixed, new_conv = plugins.causal_conv1d(xin, weight, cu_seqlens, conv_state, True)
    q, k, v = mixer.split_heads(mixed)
    snaps = None
    if decode:
        out, new_rec = gated_delta_step(q[:, None], k[:, None], v[:, None], g[:, None],
                                        beta[:, None], initial_state=rec_state)
        out = out[:, 0]
    elif snap_offsets is None:
        out, new_rec = plugins.gated_delta_scan(q, k, v, g, beta, cu_seqlens, rec_state)
    else:
        out, new_rec, snap_rec = plugins.gated_delta_scan_snap(q, k, v, g, beta, cu_seqlens,
                                                               rec_state, snap_offsets)
        snaps = (_conv_snapshot(xin, weight, cu_seqlens, snap_offsets), snap_rec)
    result = (mixer.output(out, x, z) if output else None), (new_conv, new_rec)
    return result if snaps is None else (*result, snaps)


def _conv_snapshot(xin, weight, cu_seqlens, snap_offsets):
    """The conv state after `off` tokens of each sequence: the W - 1 inputs before that
    point (off >= 64, so all of them are this step's; rows without a snapshot read any valid
    row), [B, C, W - 1]."""
    W1 = weight.shape[1] - 1
    rows = (cu_seqlens[:-1] + snap_offsets - W1).unsqueeze(1) + \
        torch.arange(W1, device=xin.device)
    rows = rows.clamp(0, xin.shape[0] - 1)
    return xin[rows].transpose(1, 2)


def mamba_mixer_packed(mixer: Mamba2Mixer, x: torch.Tensor, cu_seqlens: torch.Tensor,
                       conv_state: torch.Tensor | None, rec_state: torch.Tensor | None,
                       decode: bool = False, output: bool = True,
                       snap_offsets: torch.Tensor | None = None):
    """Nemotron-H's Mamba2 mixer over packed tokens, with `linear_mixer_packed`'s contract
    (decode, output, snap_offsets and the results alike)."""
    import plugins

    z, xbc, dt = mixer.project(x)
    weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
    if decode:
        mixed, new_conv = causal_conv1d(xbc[:, None], weight, conv_state, bias=bias)
        mixed = mixed[:, 0]
    else:  # the operator has no bias: added before the activation here
        mixed, new_conv = plugins.causal_conv1d(xbc, weight, cu_seqlens, conv_state,
                                                bias is None)
        if bias is not None:
            mixed = F.silu(mixed + bias.to(mixed.dtype))
    q, k, v, g, xs = mixer.scan_inputs(mixed, dt)
    snaps = None
    if decode:
        out, new_rec = recurrent_ssd(q[:, None], k[:, None], v[:, None], g[:, None],
                                     initial_state=rec_state)
        out = out[:, 0]
    elif snap_offsets is None:
        out, new_rec = plugins.ssd_scan(q, k, v, g, cu_seqlens, rec_state)
    else:
        out, new_rec, snap_rec = plugins.ssd_scan_snap(q, k, v, g, cu_seqlens, rec_state,
                                                       snap_offsets)
        snaps = (_conv_snapshot(xbc, weight, cu_seqlens, snap_offsets), snap_rec)
    result = (mixer.output(out, xs, z, x.dtype) if output else None), (new_conv, new_rec)
    return result if snaps is None else (*result, snaps)


def linear_layer_packed(layer: DecoderLayer | NemotronHBlock, x, cu_seqlens, conv_state,
                        rec_state, decode: bool = False, output: bool = True,
                        snap_offsets=None, fused: dict | None = None):
    """A layer with a recurrent state over packed tokens: Qwen3.5's decoder layer (Gated
    DeltaNet, then the MLP; `fused`: its `fused_weights`, else each projection on its own)
    or Nemotron-H's Mamba2 block."""
    if isinstance(layer, NemotronHBlock):
        h, *states = mamba_mixer_packed(layer.mixer, layer.norm(x), cu_seqlens, conv_state,
                                        rec_state, decode, output, snap_offsets)
        return (x + h if output else None), *states
    h, *states = linear_mixer_packed(layer.linear_attn, layer.input_layernorm(x), cu_seqlens,
                                     conv_state, rec_state, decode, output, snap_offsets,
                                     fused.get("in") if fused else None)
    return (_ffn(layer, x + h, fused) if output else None), *states


def _ffn(layer: DecoderLayer, x: torch.Tensor, fused: dict | None) -> torch.Tensor:
    if isinstance(layer.mlp, SparseMoE):
        return x + layer.mlp(layer.post_attention_layernorm(x),
                             experts=_experts_op(layer.mlp, fused))
    if not fused or "gate_up" not in fused:
        return layer._ffn(x)
    gate, up = F.linear(layer.post_attention_layernorm(x), fused["gate_up"]).split(
        layer.mlp.gate_proj.out_features, -1)
    return x + layer.mlp.down_proj(F.silu(gate) * up)


def _experts_op(moe: SparseMoE | NemotronMoE, weights: dict | None):
    """The routed experts of MoE layer `moe` through `plugins.moe_experts` over its stacked
    weights (`layer_weights`): the loop over expert modules is not a graph."""
    import plugins

    if not weights or "experts_in" not in weights:
        raise ValueError("a mixture-of-experts layer in a packed graph needs its stacked "
                         "expert weights (layer_weights)")
    return lambda h, w, index: plugins.moe_experts(h, w, index, weights["experts_in"],
                                                   weights["experts_down"], moe.activation)


def _mlp_block(layer: NemotronHBlock, x: torch.Tensor, weights: dict | None) -> torch.Tensor:
    """A Nemotron-H MLP or MoE layer over packed tokens."""
    if isinstance(layer.mixer, NemotronMoE):
        return x + layer.mixer(layer.norm(x), experts=_experts_op(layer.mixer, weights))
    return layer.mix_stateless(x, None, None, None)


def layer_weights(layer: nn.Module, fuse: bool) -> dict[str, torch.Tensor]:
    """What a packed graph keeps per layer besides the model's parameters: the projections
    that read one input concatenated (`fused_weights`, Qwen3.5's layers, `fuse`), and a MoE
    layer's experts stacked (`experts_in`, `experts_down`)."""
    out = dict(fused_weights(layer)) if fuse and isinstance(layer, DecoderLayer) else {}
    mlp = layer.mlp if isinstance(layer, DecoderLayer) else layer.mixer
    if isinstance(mlp, (SparseMoE, NemotronMoE)):
        out["experts_in"], out["experts_down"] = mlp.stacked_weights()
    return out


class _LayerWeights(nn.Module):
    """Registers `layer_weights` of the model's layers as buffers, so that export keeps
    them as constants (a snapshot of the weights, as the exported graph is anyway)."""

    def _register_layer_weights(self, model: HybridForCausalLM, layer_ids, fuse: bool):
        self._weight_names: dict[int, dict[str, str]] = {}
        for i in layer_ids:
            names = self._weight_names[i] = {}
            for key, w in layer_weights(model.model.layers[i], fuse).items():
                self.register_buffer(f"w_{i}_{key}", w, persistent=False)
                names[key] = f"w_{i}_{key}"

    def _weights(self, i: int) -> dict[str, torch.Tensor]:
        return {k: getattr(self, n) for k, n in self._weight_names.get(i, {}).items()}


class StepGraph(_LayerWeights):
    """One engine step over packed tokens; see the module docstring for the contract.

    Inputs: input_ids, positions [N] (packed); cu_seqlens [B + 1]; state_slots [B]; fresh [B]
    (bool: the sequence starts from zero state); write_slots [N] (KV slot of each token);
    pad_index [N] (row of each token in the padded [B * T] view); read_slots [B, C];
    attn_mask [B, 1, T, C] (bool); capture_src [M] (packed rows), capture_dst [M]; then the
    buffers mutated in place: anchors (one [R, D] per group), k, v (per attention layer),
    conv, rec (per linear layer). T is attn_mask's third dimension. With `snapshots`
    (prefill): snap_offsets [B] and snap_slots [B], then saved_conv, saved_rec (the saved
    state slots, per linear layer): each sequence's states after its first snap_offsets[b]
    new tokens go to slot snap_slots[b] (a scratch slot where the offset is 0).
    """

    def __init__(self, model: HybridForCausalLM, decode: bool = False,
                 snapshots: bool = False) -> None:
        super().__init__()
        self.model = model
        self.decode = decode  # every sequence adds exactly one token
        if snapshots and decode:
            raise ValueError("decode steps take no mid-step snapshots")
        self.snapshots = snapshots
        cfg = model.config
        self.entry_to_group = {e: g for g, e in enumerate(cfg.group_entry_layers)}
        # One product per input (`fused_weights`) and MoE layers' stacked experts.
        self._register_layer_weights(model, range(cfg.num_hidden_layers), fuse=True)

    def forward(self, input_ids, positions, cu_seqlens, state_slots, fresh, write_slots,
                pad_index, read_slots, attn_mask, capture_src, capture_dst,
                anchors: tuple, k_pool: tuple, v_pool: tuple, conv: tuple, rec: tuple,
                snap_offsets=None, snap_slots=None, saved_conv: tuple = (),
                saved_rec: tuple = ()):
        m = self.model
        B, T = attn_mask.shape[0], attn_mask.shape[2]
        x = m.model.embed_tokens(input_ids)
        cos, sin = m.rotary.cos_sin(positions, x.dtype) if m.rotary else (None, None)
        keep = (~fresh).view(-1, 1, 1)
        for i, layer in enumerate(m.model.layers):
            if i in self.entry_to_group:
                import plugins

                plugins.anchor_capture(x, capture_src, capture_dst,
                                       anchors[self.entry_to_group[i]])
            if layer.is_linear:
                li = layer.state_index
                c0 = conv[li].index_select(0, state_slots) * keep.to(conv[li].dtype)
                r0 = rec[li].index_select(0, state_slots) * keep.unsqueeze(-1).float()
                if self.snapshots:
                    x, (c1, r1), (sc, sr) = linear_layer_packed(
                        layer, x, cu_seqlens, c0, r0, snap_offsets=snap_offsets,
                        fused=self._weights(i))
                    saved_conv[li].index_copy_(0, snap_slots, sc.to(saved_conv[li].dtype))
                    saved_rec[li].index_copy_(0, snap_slots, sr)
                else:
                    x, (c1, r1) = linear_layer_packed(layer, x, cu_seqlens, c0, r0,
                                                      self.decode, fused=self._weights(i))
                conv[li].index_copy_(0, state_slots, c1.to(conv[li].dtype))
                rec[li].index_copy_(0, state_slots, r1)
            elif isinstance(layer, NemotronHBlock) and not layer.is_attention:
                x = _mlp_block(layer, x, self._weights(i))  # an MLP or MoE layer
            else:
                attn, norm = ((layer.mixer, layer.norm) if isinstance(layer, NemotronHBlock)
                              else (layer.self_attn, layer.input_layernorm))
                fused = self._weights(i)
                h = _attention_packed(attn, norm(x), cos, sin, k_pool[attn.attn_index],
                                      v_pool[attn.attn_index], write_slots, pad_index,
                                      read_slots, attn_mask, B, T, fused)
                x = x + h if isinstance(layer, NemotronHBlock) else _ffn(layer, x + h, fused)
        last = m.model.norm(x.index_select(0, cu_seqlens[1:] - 1))
        return m.lm_head(last).float()


def _attention_packed(attn, x, cos, sin, k_pool, v_pool, write_slots, pad_index, read_slots,
                      attn_mask, B, T, fused: dict | None = None):
    N = x.shape[0]
    H, Hkv, Dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if fused and "qkv" in fused:
        qg, k, v = F.linear(x, fused["qkv"], fused.get("qkv_bias")).split(
            [H * 2 * Dh, Hkv * Dh, Hkv * Dh], -1)
    else:
        qg, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if attn.gated:  # Qwen3.5: q/k norms, rotary, an output gate
        q, gate = qg.view(N, H, 2 * Dh).chunk(2, dim=-1)
        q = apply_rotary(attn.q_norm(q), cos, sin)
        k = apply_rotary(attn.k_norm(k.view(N, Hkv, Dh)), cos, sin)
    else:  # Nemotron-H: none of them
        q, gate, k = qg.view(N, H, Dh), None, k.view(N, Hkv, Dh)
    v = v.view(N, Hkv, Dh)
    k_pool.index_copy_(0, write_slots, k.to(k_pool.dtype))
    v_pool.index_copy_(0, write_slots, v.to(v_pool.dtype))
    q_pad = q.new_zeros(B * T, H, Dh).index_copy(0, pad_index, q).view(B, T, H, Dh)
    k_ctx, v_ctx = k_pool[read_slots], v_pool[read_slots]  # [B, C, Hkv, Dh]
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k_ctx.transpose(1, 2),
                                         v_ctx.transpose(1, 2), attn_mask=attn_mask,
                                         enable_gqa=True)
    out = out.transpose(1, 2).reshape(B * T, H * Dh).index_select(0, pad_index)
    if gate is not None:
        out = out * torch.sigmoid(gate.reshape(N, H * Dh))
    return attn.o_proj(out)


class ReplayGraph(_LayerWeights):
    """Group `group`'s layers from zero state over packed hidden states.

    Inputs: hidden [N, D] (packed anchors), cu_seqlens [B + 1]. Returns a flat tuple
    (conv_0, rec_0, conv_1, rec_1, ...) of final states, one pair per state layer of the
    group (`config.group_state_layers`; Nemotron-H's MLP layers between them run too).
    """

    def __init__(self, model: HybridForCausalLM, group: int) -> None:
        super().__init__()
        self.model = model
        self.layer_ids = list(model.config.groups[group])
        self._register_layer_weights(model, self.layer_ids, fuse=False)  # MoE experts only

    def forward(self, hidden, cu_seqlens):
        x = hidden.to(self.model.dtype)
        out = []
        for i, layer_id in enumerate(self.layer_ids):
            layer = self.model.model.layers[layer_id]
            if not layer.is_linear:  # an MLP or MoE layer (Nemotron-H)
                x = _mlp_block(layer, x, self._weights(layer_id))
                continue
            # The last layer's output feeds nothing: its states only.
            x, (c, r) = linear_layer_packed(layer, x, cu_seqlens, None, None,
                                            output=i + 1 < len(self.layer_ids),
                                            fused=self._weights(layer_id) or None)
            out += [c, r]
        return tuple(out)


def packed_from_batch(batch: ForwardBatch, capture_src: torch.Tensor | None):
    """StepGraph's index inputs from a planned ForwardBatch (with KV and state slots).

    capture_src (flat rows of the padded [B * T] view, as the eager Capture takes them) is
    translated to packed rows. Returns a dict of tensors.
    """
    rows = batch.write_rows  # padded rows of the real tokens, in packed order
    B, T = batch.input_ids.shape
    cu = torch.zeros(B + 1, dtype=torch.long, device=rows.device)
    cu[1:] = batch.lengths.cumsum(0)
    read = batch.read_slots()
    if read is None:  # a fresh batch reads exactly what it writes
        width = T
        read = torch.zeros(B, width, dtype=torch.long, device=rows.device)
        read.view(-1).index_copy_(0, rows, batch.write_slots)
        key_pos = torch.arange(width, device=rows.device).view(1, 1, 1, width)
        mask = key_pos <= batch.positions.view(B, 1, T, 1)
    else:
        mask = batch.attn_mask
    fresh = torch.zeros(B, dtype=torch.bool, device=rows.device)
    if batch.fresh:
        fresh[:] = True
    elif batch.fresh_rows is not None:
        fresh = batch.fresh_rows.to(rows.device)
    src = torch.zeros(0, dtype=torch.long, device=rows.device)
    if capture_src is not None and capture_src.numel():
        inverse = torch.full((B * T,), -1, dtype=torch.long, device=rows.device)
        inverse[rows] = torch.arange(rows.numel(), device=rows.device)
        src = inverse[capture_src.to(rows.device)]
        if bool((src < 0).any()):
            raise ValueError("capture positions must be tokens of this step")
    return {
        "input_ids": batch.input_ids.reshape(-1).index_select(0, rows),
        "positions": batch.positions.reshape(-1).index_select(0, rows),
        "cu_seqlens": cu, "state_slots": batch.state_slots, "fresh": fresh,
        "write_slots": batch.write_slots, "pad_index": rows, "read_slots": read,
        "attn_mask": mask, "capture_src": src,
    }
