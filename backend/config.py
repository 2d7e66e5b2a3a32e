"""Frozen configuration objects shared by the model, the cache and the engine."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"
MLP = "mlp"  # Nemotron-H: a layer that is only an MLP (no token mixer)
MOE = "moe"  # Nemotron-H: a mixture-of-experts MLP layer (routed + shared experts)
QWEN3_NEXT = "qwen3_next"  # Qwen3.5's layers; its projections packed (qkvz, ba); MoE MLPs
QWEN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", QWEN3_NEXT)
NEMOTRON_H = "nemotron_h"
# Nemotron-H's `hybrid_override_pattern` letters -> layer types, and back.
NEMOTRON_H_CODES = {"M": LINEAR, "*": FULL, "-": MLP, "E": MOE}
NEMOTRON_H_LETTERS = {t: c for c, t in NEMOTRON_H_CODES.items()}
SUPPORTED_MODEL_TYPES = (*QWEN_MODEL_TYPES, NEMOTRON_H)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a hybrid model (HF field names, text part only).

    Two families: Qwen3.5 (every layer a Gated DeltaNet or gated attention mixer, each with a
    SwiGLU MLP) and Nemotron-H (`model_type` "nemotron_h": each layer one block, a Mamba2
    mixer, plain attention without positional encoding, or a squared-ReLU MLP). For Nemotron-H
    the `linear_*` fields describe the Mamba2 mixer in the same state layout as Gated
    DeltaNet's: key heads = the B/C groups (`n_groups`), key head dim = `ssm_state_size`,
    value heads = `mamba_num_heads`, value head dim = `mamba_head_dim`; so the conv runs over
    2 * key_dim + value_dim channels and the recurrent state is [heads, d_state, head_dim].
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    eos_token_id: int | None = None
    model_type: str = "qwen3_5_text"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0, got {self.intermediate_size}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        kinds = (LINEAR, FULL, MLP, MOE) if self.is_nemotron_h else (LINEAR, FULL)
        bad = sorted({t for t in self.layer_types if t not in kinds})
        if bad:
            raise ValueError(f"unknown layer types {bad}; expected one of {kinds}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta}")
        act = "relu2" if self.is_nemotron_h else "silu"
        if self.hidden_act != act:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only {act!r})")
        if self.is_nemotron_h:
            if self.rotary_dim:
                raise ValueError("Nemotron-H attention has no rotary embedding (partial_"
                                 f"rotary_factor must be 0, got {self.partial_rotary_factor})")
        elif self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary dim "
                f"{self.rotary_dim} for head_dim={self.head_dim}; "
                "it must be even and in (0, head_dim]"
            )

    # Derived shapes -------------------------------------------------------------------
    @property
    def is_nemotron_h(self) -> bool:
        return self.model_type == NEMOTRON_H

    @property
    def has_moe(self) -> bool:
        """Mixture-of-experts MLPs (Nemotron-H's `moe` layers, Qwen3-Next's sparse MLPs)."""
        return "moe" in self.extra

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers (decoder layer indices) of each group: a maximal run of layers without
        attention, from its first linear layer to its last (Nemotron-H's MLP and MoE layers in
        between belong to it; those before or after carry no state and need no replay)."""
        runs: list[list[int]] = [[]]
        for i, t in enumerate(self.layer_types):
            if t == FULL:
                runs.append([])
            else:
                runs[-1].append(i)
        out = []
        for run in runs:
            linear = [i for i in run if self.layer_types[i] == LINEAR]
            if linear:
                out.append(tuple(range(linear[0], linear[-1] + 1)))
        return tuple(out)

    @property
    def group_state_layers(self) -> tuple[tuple[int, ...], ...]:
        """The linear (state-carrying) layers of each group, in order: what `replay_group`
        returns states for. The same as `groups` for Qwen3.5."""
        return tuple(tuple(i for i in g if self.layer_types[i] == LINEAR) for g in self.groups)

    @property
    def group_entry_layers(self) -> tuple[int, ...]:
        """Index of the first decoder layer of each group: its input is the group's anchor."""
        return tuple(g[0] for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # Construction ---------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Builds the config from an HF config.json dict (`qwen3_5`, `qwen3_5_text`,
        `qwen3_next` or `nemotron_h`)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        _check_whole(raw)
        if model_type == NEMOTRON_H:
            return cls._from_nemotron_h(raw)
        text = dict(raw.get("text_config", raw)) if model_type == "qwen3_5" else dict(raw)
        _check_whole(text)
        rope = dict(text.get("rope_parameters") or {})
        # Only the plain rotary embedding is implemented: a scaled one (yarn, linear, dynamic,
        # ...) served as plain would give other logits, so it is refused.
        for where, spec in (("rope_parameters", rope), ("rope_scaling",
                                                        text.get("rope_scaling") or {})):
            kind = spec.get("rope_type", spec.get("type", "default")) \
                if isinstance(spec, dict) else spec
            if kind != "default":
                raise ValueError(f"{where} asks for rope_type {kind!r}; only the default "
                                 "rotary embedding is supported")
        num_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        heads = int(text["num_attention_heads"])
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        moe = _qwen3_next_moe(text, num_layers) if model_type == QWEN3_NEXT else None
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
            ),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=_flag(
                raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
                "tie_word_embeddings"),
            attention_bias=_flag(text.get("attention_bias", False), "attention_bias"),
            hidden_act=str(text.get("hidden_act", "silu")),
            eos_token_id=_eos(eos),
            model_type=model_type,
            extra={"rope_type": rope.get("rope_type", "default"),
                   **({"moe": moe} if moe else {})},
        )

    @classmethod
    def _from_nemotron_h(cls, raw: dict[str, Any]) -> ModelConfig:
        """Nemotron-H: layers from `layers_block_type` (transformers 5) or the checkpoints'
        `hybrid_override_pattern` (M Mamba2, * attention, - MLP, E mixture of experts)."""
        types = raw.get("layers_block_type") or raw.get("layer_types")
        if types is None:
            pattern = str(raw["hybrid_override_pattern"])
            bad = sorted(set(pattern) - set(NEMOTRON_H_CODES))
            if bad:
                raise ValueError(f"hybrid_override_pattern has unknown layer codes {bad}")
            types = [NEMOTRON_H_CODES[c] for c in pattern]
        types = [str(t) for t in types]
        eos = raw.get("eos_token_id")
        heads = int(raw["num_attention_heads"])

        def pick(*names: str, default=None):
            for n in names:
                if raw.get(n) is not None:
                    return raw[n]
            if default is None:
                raise KeyError(names[0])
            return default

        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=len(types),
            layer_types=tuple(types),
            num_attention_heads=heads,
            num_key_value_heads=int(pick("num_key_value_heads", default=heads)),
            head_dim=int(pick("head_dim", "attention_head_dim",
                              default=int(raw["hidden_size"]) // heads)),
            linear_num_key_heads=int(pick("n_groups", "mamba_n_groups", default=8)),
            linear_num_value_heads=int(raw["mamba_num_heads"]),
            linear_key_head_dim=int(pick("ssm_state_size", "mamba_d_state", default=128)),
            linear_value_head_dim=int(raw["mamba_head_dim"]),
            linear_conv_kernel_dim=int(pick("conv_kernel", "mamba_d_conv", default=4)),
            rms_norm_eps=float(pick("layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
            partial_rotary_factor=0.0,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=_flag(raw.get("tie_word_embeddings", False),
                                      "tie_word_embeddings"),
            # transformers' Nemotron-H attention has no biases whatever attention_bias says
            attention_bias=False,
            hidden_act=str(pick("mlp_hidden_act", default="relu2")),
            eos_token_id=_eos(eos),
            model_type=NEMOTRON_H,
            extra={
                "use_conv_bias": _flag(pick("use_conv_bias", "mamba_conv_bias", default=True),
                                       "use_conv_bias"),
                "mamba_proj_bias": _flag(pick("use_bias", "mamba_proj_bias", default=False),
                                         "use_bias"),
                "mlp_bias": _flag(raw.get("mlp_bias", False), "mlp_bias"),
                # dt = softplus(.) clamped to time_step_limit, as transformers 5 does (every
                # form, decode included, so a cached state equals a prefilled one);
                # time_step_min only sets dt_bias at initialisation (training).
                "dt_limit": _dt_limit(pick("time_step_limit", "mamba_dt_limit",
                                           default=(0.0, math.inf))),
                "dt_min": float(pick("time_step_min", "mamba_dt_min", default=0.001)),
                **({"moe": _moe_config(raw, pick)} if MOE in types else {}),
            },
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except OSError as e:
            raise FileNotFoundError(f"cannot read model config {path}: {e}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"model config {path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"model config {path} is not a JSON object")
        try:
            return cls.from_hf_dict(raw)
        except KeyError as e:
            raise ValueError(f"model config {path} lacks required field {e}") from e
        except (TypeError, ArithmeticError, IndexError, AttributeError) as e:
            raise ValueError(f"model config {path} holds a value that cannot be used: "
                             f"{e}") from e


# Config fields that count something: a fraction (num_attention_heads: 4.7) would be cut by
# int() into a model other than the one its weights were trained as.
_WHOLE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "full_attention_interval", "num_attention_heads", "num_key_value_heads", "head_dim",
    "attention_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "max_position_embeddings", "n_groups", "mamba_n_groups", "mamba_num_heads",
    "ssm_state_size", "mamba_d_state", "mamba_head_dim", "conv_kernel", "mamba_d_conv",
    "n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
    "shared_expert_intermediate_size", "n_group", "topk_group", "n_shared_experts",
    "decoder_sparse_step")


def _check_whole(raw: Any) -> None:
    """ValueError naming the first counting field that is not a whole number (a float with a
    fraction, a bool, a string); whole floats (8.0) pass, as int() reads them."""
    if not isinstance(raw, dict):
        return  # (the field look-ups that follow say what is wrong)
    for name in _WHOLE_FIELDS:
        value = raw.get(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            continue
        if not (isinstance(value, float) and value.is_integer()):
            raise ValueError(f"{name} must be a whole number, got {value!r}")


def _moe_config(raw: dict[str, Any], pick) -> dict[str, Any]:
    """Nemotron-H's mixture-of-experts fields (transformers' names): routed experts of
    `moe_intermediate_size` (through a latent projection when `moe_latent_size` is set), a
    shared expert, a sigmoid router choosing `num_experts_per_tok` experts among the
    `topk_group` best of `n_group` groups."""
    out = {
        "num_experts": int(pick("n_routed_experts", "num_local_experts")),
        "top_k": int(raw["num_experts_per_tok"]),
        "intermediate_size": int(raw["moe_intermediate_size"]),
        "shared_intermediate_size": int(pick("moe_shared_expert_intermediate_size",
                                             "moe_intermediate_size")),
        "latent_size": None if raw.get("moe_latent_size") is None
        else int(raw["moe_latent_size"]),
        "n_group": int(pick("n_group", default=1)),
        "topk_group": int(pick("topk_group", default=1)),
        "norm_topk_prob": bool(pick("norm_topk_prob", default=True)),
        "routed_scaling_factor": float(pick("routed_scaling_factor", default=1.0)),
    }
    if int(raw.get("n_shared_experts", 1)) != 1:
        raise ValueError(f"n_shared_experts={raw['n_shared_experts']}: Nemotron-H MoE layers "
                         "have one shared expert")
    if out["num_experts"] % out["n_group"] or not 0 < out["topk_group"] <= out["n_group"]:
        raise ValueError(f"n_routed_experts={out['num_experts']} with n_group={out['n_group']},"
                         f" topk_group={out['topk_group']}: the groups must divide the experts")
    return _checked_top_k(out)


def _checked_top_k(moe: dict[str, Any]) -> dict[str, Any]:
    if not 0 < moe["top_k"] <= moe["num_experts"]:
        raise ValueError(f"num_experts_per_tok={moe['top_k']} must be in "
                         f"1..{moe['num_experts']}")
    return moe


def _qwen3_next_moe(raw: dict[str, Any], num_layers: int) -> dict[str, Any] | None:
    """Qwen3-Next's sparse MLPs: layers (i + 1) % decoder_sparse_step == 0 outside
    `mlp_only_layers` have `num_experts` SwiGLU experts (softmax router, top
    `num_experts_per_tok`) and a shared expert behind a sigmoid gate. Fields a config leaves
    out take transformers' Qwen3NextConfig defaults (512 experts of 512, top 10, a shared
    expert of 512); `num_experts: 0` means dense MLPs (None)."""
    num_experts = int(raw.get("num_experts", 512))
    if not num_experts:
        return None
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    return _checked_top_k({
        "num_experts": num_experts,
        "top_k": int(raw.get("num_experts_per_tok", 10)),
        "intermediate_size": int(raw.get("moe_intermediate_size", 512)),
        "shared_intermediate_size": int(raw.get("shared_expert_intermediate_size", 512)),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "layers": tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    })


def _flag(value: Any, name: str) -> bool:
    """A config's true / false: a JSON boolean (0 / 1 as some exporters write them); a
    string such as "false" is refused (bool("false") would read it as true)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"config field {name!r} must be true or false, got {value!r}")


def _eos(value: Any) -> int | None:
    """eos_token_id: an id, a list of ids (the first is the engine's end id) or none."""
    first = value[0] if isinstance(value, list) and value else value
    if first is None or isinstance(first, int) and not isinstance(first, bool) and first >= 0:
        return first
    raise ValueError(f"eos_token_id must be a token id (an integer >= 0) or a list of them, "
                     f"got {value!r}")


def _dt_limit(value: Any) -> tuple[float, float]:
    """Nemotron-H's time_step_limit: [low, high] with 0 <= low <= high (high may be inf:
    transformers writes it {"__float__": "Infinity"}, Python's json Infinity)."""
    try:
        low, high = (float(v["__float__"] if isinstance(v, dict) else v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit must be [low, high], got {value!r}") from None
    if not 0 <= low <= high:
        raise ValueError(f"time_step_limit must be [low, high] with 0 <= low <= high, got "
                         f"{value!r}")
    return low, high

