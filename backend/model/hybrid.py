"""The hybrid decoder: layer layout, groups, full forward, capture and group replay.

Two families behind one interface. Parameter names follow the Hugging Face checkpoints
(Qwen3.5: `model.layers.N.linear_attn...`; Nemotron-H: `model.layers.N.mixer...`,
`model.embeddings`, `model.norm_f`), so a checkpoint's state dict loads without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.config import FULL, LINEAR, MOE, ModelConfig
from backend.model import lora
from backend.model.attention import Attention
from backend.model.batch import Capture, ForwardBatch, SeqInput, Snapshots
from backend.model.gated_deltanet import GatedDeltaNet, LinearState
from backend.model.linear import Linear
from backend.model.mamba2 import Mamba2Mixer
from backend.model.mlp import NemotronMoE, ReluSquaredMLP, SparseMoE, SwiGLU
from backend.model.norm import PlainRMSNorm, RMSNorm
from backend.model.rotary import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer_id] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
            self.state_index = cfg.linear_layer_ids.index(layer_id)
        else:
            self.self_attn = Attention(cfg, cfg.attention_layer_ids.index(layer_id))
        moe = cfg.extra.get("moe")
        self.mlp = (SparseMoE(cfg.hidden_size, moe) if moe and layer_id in moe["layers"]
                    else SwiGLU(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def mix_linear(
        self, x: torch.Tensor, state: LinearState | None, valid, lengths, output: bool = True,
        snapshots: Snapshots | None = None,
    ) -> tuple[torch.Tensor | None, LinearState]:
        """output=False: only the final states (None for the layer's output). `snapshots`:
        the states after the requested tokens are written to their slots too."""
        if snapshots is None:
            h, new_state = self.linear_attn(self.input_layernorm(x), state, valid, lengths,
                                            output)
        else:
            h, new_state, (conv, rec) = self.linear_attn(
                self.input_layernorm(x), state, valid, lengths, output,
                snapshot_at=(snapshots.rows, snapshots.offsets))
            snapshots.write(self.state_index, conv, rec)
        return (self._ffn(x + h) if output else None), new_state

    def mix_stateless(self, x, cos, sin, batch: ForwardBatch | None) -> torch.Tensor:
        """A layer without recurrent state (here: attention, then the MLP)."""
        return self._ffn(x + self.self_attn(self.input_layernorm(x), cos, sin, batch))

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridTextModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class NemotronHBlock(nn.Module):
    """One Nemotron-H layer: x + mixer(norm(x)), the mixer a Mamba2 mixer, plain attention,
    a squared-ReLU MLP or a mixture of such experts."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        kind = cfg.layer_types[layer_id]
        self.is_linear = kind == LINEAR
        self.is_attention = kind == FULL
        self.norm = PlainRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if self.is_linear:
            self.mixer = Mamba2Mixer(cfg)
            self.state_index = cfg.linear_layer_ids.index(layer_id)
        elif self.is_attention:
            self.mixer = Attention(cfg, cfg.attention_layer_ids.index(layer_id))
        elif kind == MOE:
            self.mixer = NemotronMoE(cfg.hidden_size, cfg.extra["moe"],
                                     bias=bool(cfg.extra.get("mlp_bias", False)))
        else:
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size,
                                        bias=bool(cfg.extra.get("mlp_bias", False)))

    def mix_linear(
        self, x: torch.Tensor, state: LinearState | None, valid, lengths, output: bool = True,
        snapshots: Snapshots | None = None,
    ) -> tuple[torch.Tensor | None, LinearState]:
        """As `DecoderLayer.mix_linear`."""
        if snapshots is None:
            h, new_state = self.mixer(self.norm(x), state, valid, lengths, output)
        else:
            h, new_state, (conv, rec) = self.mixer(
                self.norm(x), state, valid, lengths, output,
                snapshot_at=(snapshots.rows, snapshots.offsets))
            snapshots.write(self.state_index, conv, rec)
        return (x + h if output else None), new_state

    def mix_stateless(self, x, cos, sin, batch: ForwardBatch | None) -> torch.Tensor:
        if self.is_attention:
            return x + self.mixer(self.norm(x), cos, sin, batch)
        return x + self.mixer(self.norm(x))


class NemotronHTextModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm_f = PlainRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    # The names the shared code uses.
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.embeddings

    @property
    def norm(self) -> PlainRMSNorm:
        return self.norm_f


class HybridForCausalLM(nn.Module):
    """Hybrid LM (Qwen3.5 or Nemotron-H). Public entry points: `logits`, `forward_batch`,
    `replay_group`, `capture_hidden`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = NemotronHTextModel(cfg) if cfg.is_nemotron_h else HybridTextModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Nemotron-H's attention has no positional encoding.
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta) if cfg.rotary_dim else None
        self._entry_to_group = {e: g for g, e in enumerate(cfg.group_entry_layers)}
        # Fused copies for one-token CPU steps (`backend/model/decode.py`), set by load_model.
        self.fast_decode = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # Plain prefill -------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, T] -> logits [B, T, V] of a full prefill from empty state (trainable)."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return self.lm_head(self._run_layers(input_ids, positions, None))

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, V] logits of a plain full prefill."""
        return self.forward(input_ids.to(self.device))

    # Cached, batched forward ------------------------------------------------------------
    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch, last_only: bool = True,
                      logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step over variable-length sequences reading/writing paged KV and states.

        Returns logits [B, V] at each sequence's last new token (or [B, T, V] if not last_only;
        [N, V] at `logit_index`, N flat indices into the right-padded [B, T] tokens).
        Steps of a few tokens a row on the CPU (decode, verification) take `fast_decode`
        when the model has one (same arithmetic, the recurrences a token at a time).
        """
        if batch.lora is not None:  # rows on LoRA adapters: their terms added (`lora.py`)
            with lora.active(batch.lora, batch.input_ids.shape[1]):
                return self._forward_batch(batch, last_only, logit_index)
        return self._forward_batch(batch, last_only, logit_index)

    def _forward_batch(self, batch: ForwardBatch, last_only: bool,
                       logit_index: torch.Tensor | None) -> torch.Tensor:
        fast = (self.fast_decode is not None and (last_only or logit_index is not None)
                and self.fast_decode.accepts(batch))
        if fast and batch.input_ids.shape[1] == 1 and logit_index is None:
            return self.lm_head(self.fast_decode.run(batch))
        if fast:
            hidden = self.fast_decode.run(batch)
            if hidden.dim() == 2:
                hidden = hidden.unsqueeze(1)
        else:
            hidden = self._run_layers(batch.input_ids, batch.positions, batch)
        return self._logits_of(hidden, batch, last_only, logit_index)

    def _logits_of(self, hidden: torch.Tensor, batch: ForwardBatch, last_only: bool,
                   logit_index: torch.Tensor | None) -> torch.Tensor:
        if logit_index is not None:
            return self.lm_head(hidden.flatten(0, 1).index_select(0, logit_index))
        if last_only:
            hidden = hidden[torch.arange(batch.batch_size, device=hidden.device), batch.lengths - 1]
        return self.lm_head(hidden)

    def _run_layers(self, ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype) if self.rotary else (None, None)
        valid = batch.valid if batch is not None else None
        lengths = batch.lengths if valid is not None else None
        for i, layer in enumerate(self.model.layers):
            if batch is not None and batch.capture is not None and i in self._entry_to_group:
                batch.capture.write(self._entry_to_group[i], x)
            if layer.is_linear:
                state = self._read_state(layer.state_index, batch)
                snapshots = batch.snapshots if batch is not None else None
                x, new_state = layer.mix_linear(x, state, valid, lengths, snapshots=snapshots)
                self._write_state(layer.state_index, batch, new_state)
            else:
                x = layer.mix_stateless(x, cos, sin, batch)
        return self.model.norm(x)

    @staticmethod
    def _read_state(index: int, batch) -> LinearState | None:
        if batch is None or batch.states is None or batch.fresh:
            return None
        slots = batch.state_slots
        conv = batch.states.conv[index].index_select(0, slots)
        rec = batch.states.rec[index].index_select(0, slots)
        if batch.fresh_rows is not None:
            conv[batch.fresh_rows] = 0
            rec[batch.fresh_rows] = 0
        return conv, rec

    @staticmethod
    def _write_state(index: int, batch, state: LinearState) -> None:
        if batch is None or batch.states is None:
            return
        batch.states.scatter(index, batch.state_slots, *state)

    # Suffix replay primitive ------------------------------------------------------------
    @torch.inference_mode()
    def replay_group(
        self, group: int, hidden: torch.Tensor, lengths: torch.Tensor | None = None,
        adapters: torch.Tensor | None = None,
    ) -> list[LinearState]:
        """Runs only group `group`'s layers (linear layers with their MLPs; Nemotron-H's
        MLP-only layers between them) from zero state.

        hidden: [B, T, D] entry hidden states (right-padded; `lengths` [B] when ragged).
        adapters: [B] each row's LoRA adapter (`lora.py`; None: the base model's layers).
        Returns the final (conv, recurrent) states of each linear layer of the group
        (`config.group_state_layers[group]`), in order.
        """
        if adapters is not None and bool(adapters.any()):
            with lora.active(adapters, hidden.shape[1]):
                return self.replay_group(group, hidden, lengths)
        B, T, _ = hidden.shape
        valid = None
        if lengths is not None and int(lengths.min()) < T:
            valid = torch.arange(T, device=hidden.device).unsqueeze(0) < lengths.unsqueeze(1)
        else:
            lengths = None
        x = hidden.to(self.dtype)
        states = []
        layer_ids = self.config.groups[group]
        for i, layer_id in enumerate(layer_ids):
            layer = self.model.layers[layer_id]
            if not layer.is_linear:  # an MLP-only layer (Nemotron-H)
                x = layer.mix_stateless(x, None, None, None)
                continue
            # The group's last layer: its state only (its output feeds nothing here).
            x, st = layer.mix_linear(x, None, valid, lengths, output=i + 1 < len(layer_ids))
            states.append(st)
        return states

    @torch.inference_mode()
    def capture_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Entry hidden states of every group at `positions` of a full prefill: [G, B, N, D]."""
        B, T = input_ids.shape
        N = positions.shape[-1]
        src = (torch.arange(B).unsqueeze(1) * T + positions.view(B, N)).reshape(-1)
        D = self.config.hidden_size
        buffers = torch.zeros(self.config.num_groups, B * N, D, dtype=self.dtype)
        batch = ForwardBatch.build([SeqInput(row) for row in input_ids.tolist()])
        batch.capture = Capture(src, torch.arange(B * N), buffers)
        self._run_layers(batch.input_ids, batch.positions, batch)
        return buffers.view(-1, B, N, self.config.hidden_size)
