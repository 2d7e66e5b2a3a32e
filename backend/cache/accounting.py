"""Storage per cached token: full-attention KV, SuffixReplay anchors and state checkpoints.

Computed from an HF-style config dict (Qwen3.5 / Qwen3-Next Gated DeltaNet hybrids, nested
`text_config` included, and Nemotron-H Mamba2 hybrids via `hybrid_override_pattern`).

Which checkpoint interval makes the comparison honest: a checkpoint holds the full states of
every linear layer (Qwen3.5-4B: 24 x (fp32 [32, 128, 128] + bf16 conv [8192, 3]) = 49.1 MiB)
and SGLang amortizes it over its reuse granularity. The paper's storage requirement R2 is
B_anchor <= B_ckpt / 8192 per token, i.e. checkpoints every 8192 tokens. At that interval
Qwen3.5-4B anchors (8 groups x 2560 x bf16 at density 1/16 = 2.5 KiB/token) cost 0.41x of the
checkpoint cache, inside the paper's 0.36-0.51x. The break-even interval (anchors == checkpoints)
is B_ckpt / B_anchor, about 20k tokens for Qwen3.5-4B: with checkpoints any denser than that,
anchors are the cheaper way to make those boundaries (and all other page boundaries) reusable.
(Qwen3.6-27B comes out at 0.55x at C = 8192 with bf16 anchors, a little above the paper's range;
the paper ran its FP8 checkpoint, and int8 anchors halve the figure.)

`python -m backend.cache.accounting` prints the table for the shipped configs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from backend.config import NEMOTRON_H_LETTERS

CONFIG_DIR = Path(__file__).with_name("model_configs")
KIB, MIB = 1024, 1024 * 1024
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


class AnchorFormat(NamedTuple):
    """Bytes per anchor element, plus bytes of one scale per (token, group) when quantized."""

    name: str
    elem_bytes: int
    scale_bytes: int = 0


BF16 = AnchorFormat("bf16", 2)
INT8_FP32_SCALE = AnchorFormat("int8+fp32 scale", 1, 4)
INT8_FP16_SCALE = AnchorFormat("int8+fp16 scale", 1, 2)


@dataclass(frozen=True)
class HybridLayout:
    """What storage depends on. recurrent_state: per linear layer, stored in state dtype
    (Gated DeltaNet [H_v, K, V]; Mamba2 [H, head_dim, d_state]); conv state: per linear layer
    [conv_channels, conv_kernel - 1] in the model dtype."""

    name: str
    family: str
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "linear" | "attention" | "mlp" per decoder layer
    num_kv_heads: int
    head_dim: int
    recurrent_state: tuple[int, int, int]
    conv_channels: int
    conv_kernel: int
    model_dtype_bytes: int = 2
    state_dtype_bytes: int = 4

    @property
    def num_attention_layers(self) -> int:
        return self.layer_kinds.count("attention")

    @property
    def num_linear_layers(self) -> int:
        return self.layer_kinds.count("linear")

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Runs of linear layers between attention layers (MLP-only layers do not split)."""
        runs: list[list[int]] = [[]]
        for i, kind in enumerate(self.layer_kinds):
            if kind == "attention":
                runs.append([])
            elif kind == "linear":
                runs[-1].append(i)
        return tuple(tuple(r) for r in runs if r)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def kv_bytes_per_token(self) -> int:
        return (
            self.num_attention_layers
            * 2
            * self.num_kv_heads
            * self.head_dim
            * (self.model_dtype_bytes)
        )

    def checkpoint_bytes(self) -> int:
        """One full checkpoint: recurrent + conv state of every linear layer."""
        h, k, v = self.recurrent_state
        recurrent = h * k * v * self.state_dtype_bytes
        conv = self.conv_channels * (self.conv_kernel - 1) * self.model_dtype_bytes
        return self.num_linear_layers * (recurrent + conv)

    def checkpoint_bytes_per_token(self, interval: int) -> float:
        if interval < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {interval}")
        return self.checkpoint_bytes() / interval

    def anchor_bytes_per_token(self, density: float, fmt: AnchorFormat = BF16) -> float:
        if not 0 < density <= 1:
            raise ValueError(f"anchor density must be in (0, 1], got {density}")
        per_anchor = self.hidden_size * fmt.elem_bytes + fmt.scale_bytes
        return density * self.num_groups * per_anchor

    def anchor_bytes_per_page(
        self, page_size: int, density: float, fmt: AnchorFormat = BF16
    ) -> int:
        """Size of one anchor block (all groups of one page)."""
        return round(self.anchor_bytes_per_token(density, fmt) * page_size)

    def break_even_interval(self, density: float, fmt: AnchorFormat = BF16) -> float:
        """Checkpoint interval at which checkpoints cost as much per token as anchors."""
        return self.checkpoint_bytes() / self.anchor_bytes_per_token(density, fmt)


def layout_from_hf(raw: dict[str, Any], name: str = "") -> HybridLayout:
    """Reads a Qwen3.5 / Qwen3-Next (`layer_types` or `full_attention_interval`) or a
    Nemotron-H (`hybrid_override_pattern`, or transformers 5's `layers_block_type`) config; a
    nested `text_config` wins."""
    cfg = dict(raw.get("text_config") or raw)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"
    model_bytes = _dtype_bytes(dtype)
    name = name or cfg.get("model_type") or raw.get("model_type", "model")
    if "hybrid_override_pattern" in cfg:
        return _mamba2_layout(cfg, name, model_bytes)
    if cfg.get("model_type") == "nemotron_h" and cfg.get("layers_block_type"):
        # transformers 5 saves the layer list instead of the pattern string
        pattern = "".join(NEMOTRON_H_LETTERS.get(t, "?") for t in cfg["layers_block_type"])
        return _mamba2_layout({**cfg, "hybrid_override_pattern": pattern,
                               "num_hidden_layers": len(pattern)}, name, model_bytes)
    return _gated_deltanet_layout(cfg, name, model_bytes)


def _dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def _gated_deltanet_layout(cfg: dict[str, Any], name: str, model_bytes: int) -> HybridLayout:
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    kinds = {"linear_attention": "linear", "full_attention": "attention"}
    if len(types) != num_layers or any(t not in kinds for t in types):
        raise ValueError(f"{name}: layer_types {types} do not match {num_layers} layers")
    key_dim = int(cfg["linear_num_key_heads"]) * int(cfg["linear_key_head_dim"])
    value_heads, value_dim = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
    heads = int(cfg["num_attention_heads"])
    return HybridLayout(
        name=name,
        family="gated_deltanet",
        hidden_size=int(cfg["hidden_size"]),
        layer_kinds=tuple(kinds[t] for t in types),
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        recurrent_state=(value_heads, int(cfg["linear_key_head_dim"]), value_dim),
        conv_channels=2 * key_dim + value_heads * value_dim,
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        model_dtype_bytes=model_bytes,
        state_dtype_bytes=_dtype_bytes(cfg.get("mamba_ssm_dtype", "float32")),
    )


def _mamba2_layout(cfg: dict[str, Any], name: str, model_bytes: int) -> HybridLayout:
    pattern = cfg["hybrid_override_pattern"]
    kinds = {"M": "linear", "*": "attention", "-": "mlp", "E": "mlp"}
    if len(pattern) != int(cfg["num_hidden_layers"]) or any(c not in kinds for c in pattern):
        raise ValueError(
            f"{name}: hybrid_override_pattern {pattern!r} does not match "
            f"{cfg['num_hidden_layers']} layers of kinds {sorted(kinds)}"
        )
    heads, head_dim = int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"])
    d_state = int(cfg.get("ssm_state_size") or cfg["mamba_d_state"])
    n_groups = int(cfg.get("n_groups") or cfg.get("mamba_n_groups", 8))
    num_heads = int(cfg["num_attention_heads"])
    return HybridLayout(
        name=name,
        family="mamba2",
        hidden_size=int(cfg["hidden_size"]),
        layer_kinds=tuple(kinds[c] for c in pattern),
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(
            cfg.get("attention_head_dim")
            or cfg.get("head_dim")
            or int(cfg["hidden_size"]) // num_heads
        ),
        recurrent_state=(heads, head_dim, d_state),
        # Conv runs over x, B and C: intermediate + 2 * n_groups * d_state channels.
        conv_channels=heads * head_dim + 2 * n_groups * d_state,
        conv_kernel=int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv", 4)),
        model_dtype_bytes=model_bytes,
        state_dtype_bytes=_dtype_bytes(cfg.get("mamba_ssm_cache_dtype", "float32")),
    )


def shipped_layouts() -> dict[str, HybridLayout]:
    """The configs in `backend/cache/model_configs/`, by file stem."""
    return {
        path.stem: layout_from_hf(json.loads(path.read_text()), path.stem)
        for path in sorted(CONFIG_DIR.glob("*.json"))
    }


def comparison_table(
    layouts: dict[str, HybridLayout],
    density: float = 1 / 16,
    intervals: Sequence[int] = (256, 1024, 4096, 8192),
    page_size: int = 64,
) -> str:
    """Per model: KV/token, one checkpoint, anchors/token and anchor/checkpoint ratios."""
    head = (
        f"{'model':<20}{'groups':>7}{'KV KiB/tok':>11}{'ckpt MiB':>10}"
        f"{'anc B/tok':>10}{'int8 B/tok':>11}{'block KiB':>10}"
        + "".join(f"{f'ratio@{c}':>12}" for c in intervals)
        + f"{'break-even':>11}{'R2':>5}"
    )
    lines = [head, "-" * len(head)]
    for name, lay in layouts.items():
        anchors = lay.anchor_bytes_per_token(density)
        ratios = "".join(f"{anchors / lay.checkpoint_bytes_per_token(c):>12.3f}" for c in intervals)
        r2 = anchors <= lay.checkpoint_bytes_per_token(8192)
        lines.append(
            f"{name:<20}{lay.num_groups:>7}{lay.kv_bytes_per_token() / KIB:>11.1f}"
            f"{lay.checkpoint_bytes() / MIB:>10.2f}{anchors:>10.0f}"
            f"{lay.anchor_bytes_per_token(density, INT8_FP32_SCALE):>11.0f}"
            f"{lay.anchor_bytes_per_page(page_size, density) / KIB:>10.1f}{ratios}"
            f"{lay.break_even_interval(density):>11.0f}{'ok' if r2 else 'NO':>5}"
        )
    lines.append(
        f"density {density:g} ({density * page_size:g} anchors per {page_size}-token page); "
        "ratio@C = anchor bytes / checkpoint bytes per token with a checkpoint every C tokens; "
        "R2: anchors <= checkpoint / 8192 per token (bf16 anchors)."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=1 / 16)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--intervals", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    args = parser.parse_args(argv)
    print(comparison_table(shipped_layouts(), args.density, args.intervals, args.page_size))


if __name__ == "__main__":
    main()
