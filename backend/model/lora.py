"""LoRA adapters served beside the base model, each request choosing one (or none).

An adapter is a PEFT directory: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
optionally `use_rslora`) and `adapter_model.safetensors` holding, per adapted linear layer,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. A layer's
output for a token of a request on adapter a is `W x + scale_a * B_a (A_a x)` with
`scale_a = lora_alpha / r` (`lora_alpha / sqrt(r)` with rslora): the weights are never merged,
so one batch mixes requests on different adapters and on the base model.

`attach(model, adapters)` gives every targeted `Linear` its adapters' (A, scale * B) pairs,
indexed from 1 (0: no adapter); engines go through `serve` / `withdraw`, which keep every
adapter served on the model (by any engine over it) attached, indices never reused. During
a forward, `active(rows)` says which adapter each batch row uses ([B] int64);
`Linear.forward` adds the low-rank terms of the rows on its adapters (`apply`), and so do
the CPU decode path's fused products (`decode.py`, per part, through `delta`). The engine's
prefix cache keeps each adapter's pages in a namespace of their own
(`backend.cache.radix.lora_namespace`): the same prompt under another adapter has other KV,
anchors and states.

Supported targets: the linear layers the loader maps one to one from the checkpoint
(attention q/k/v/o, Gated DeltaNet's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a /
out_proj, Mamba2's in_proj / out_proj, dense MLP projections, an MoE block's shared expert,
Qwen3-Next's router and shared expert gate, Nemotron-H's latent projections). Not: embeddings,
lm_head, the routed MoE experts, Qwen3-Next's packed in_proj_qkvz / in_proj_ba (refused at
load, by name), Nemotron-H's router (no linear layer).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the file and what."""


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    fingerprint: str = ""  # a digest of its config and weights files

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)


def load_adapter(name: str, path: str | Path, model: nn.Module) -> LoraAdapter:
    """Reads a PEFT LoRA directory for `model` (shapes and targets checked against it)."""
    from backend.model.linear import Linear

    path = Path(path)
    config_file, weights_file = path / CONFIG, path / WEIGHTS
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} is missing")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {config_file}: unreadable ({e})") from e
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not "
                           "LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1 \
            or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} needs an integer r >= 1 and "
                           f"a number lora_alpha, got r={rank!r}, lora_alpha={alpha!r}")
    for key, neutral in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(key, neutral) != neutral:
            raise AdapterError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported "
                               f"(only {neutral!r})")
    if config.get("modules_to_save"):
        raise AdapterError(f"LoRA adapter {name!r}: modules_to_save "
                           f"{config['modules_to_save']!r} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"LoRA adapter {name!r}: rank_pattern / alpha_pattern are not "
                           "supported")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):  # ("false" read as true: the wrong scale, silently)
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} use_rslora must be true or "
                           f"false, got {rslora!r}")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    if not math.isfinite(scale):  # (NaN / Infinity parse as JSON numbers; 1e308 / r < 1 ...)
        raise AdapterError(f"LoRA adapter {name!r}: {config_file}: lora_alpha={alpha!r} gives "
                           f"the scale {scale}, not a finite number")
    if not weights_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} is missing (only "
                           "safetensors adapters are read)")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as st:
            for key in st.keys():
                match = _KEY.fullmatch(key.removeprefix(_PREFIX))
                if match is None:
                    raise AdapterError(f"LoRA adapter {name!r}: {weights_file}: tensor {key!r} "
                                       "is not a lora_A / lora_B weight")
                module = _canonical(match.group(1))
                parts.setdefault(module, {})[match.group(2)] = st.get_tensor(key)
    except SafetensorError as e:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file}: unreadable ({e})") from e
    if not parts:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    adapter = LoraAdapter(name, path, rank, float(scale), fingerprint=_digest(
        [config_file, weights_file]))
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    for module, ab in sorted(parts.items()):
        linear = None if ".experts." in module or module == "lm_head" else linears.get(module)
        if linear is None:
            raise AdapterError(f"LoRA adapter {name!r}: {module!r} is not a linear layer this "
                               "model can adapt (embeddings, lm_head, MoE experts and "
                               "Qwen3-Next's packed projections are not)")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {module!r} lacks its lora_"
                               f"{'B' if 'A' in ab else 'A'} weight")
        a, b = ab["A"], ab["B"]
        if not (a.is_floating_point() and b.is_floating_point()
                and torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"LoRA adapter {name!r}: {module!r} has weights that are not "
                               "finite floating-point numbers")
        want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != want_a or \
                tuple(b.shape) != want_b:
            raise AdapterError(f"LoRA adapter {name!r}: {module!r} has lora_A "
                               f"{tuple(a.shape)} and lora_B {tuple(b.shape)}; rank {rank} "
                               f"and the layer ({linear.in_features} -> "
                               f"{linear.out_features}) want {want_a} and {want_b}")
        scaled = (b.float() * scale).to(device=device, dtype=dtype).contiguous()
        if not torch.isfinite(scaled).all():  # (lora_alpha 1e30: B * scale past the dtype)
            raise AdapterError(f"LoRA adapter {name!r}: {module!r}: lora_B times the scale "
                               f"{scale:g} leaves the range of {dtype}")
        a = a.to(device=device, dtype=dtype).contiguous()
        if not torch.isfinite(a).all():  # (float32 1e5 on a float16 model)
            raise AdapterError(f"LoRA adapter {name!r}: {module!r}: lora_A leaves the range of "
                               f"{dtype}")
        adapter.weights[module] = (a, scaled)
    return adapter


def save_adapter(path: str | Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 alpha: float, rslora: bool = False) -> Path:
    """Writes an adapter in PEFT's saved layout: `weights` maps a module name (the
    checkpoint's naming) to its (lora_A [r, in], lora_B [out, r]); one rank for all."""
    from safetensors.torch import save_file

    ranks = {a.shape[0] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"one rank for every module, got {sorted(ranks)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in weights.items():
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(path / WEIGHTS))
    targets = sorted({name.rsplit(".", 1)[-1] for name in weights})
    (path / CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "r": ranks.pop(), "lora_alpha": alpha, "target_modules": targets,
        "bias": "none", "use_rslora": rslora, "task_type": "CAUSAL_LM"}, indent=2))
    return path


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as stream:
            while chunk := stream.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:32]


def _canonical(module: str) -> str:
    """A PEFT module name in the loader's naming (Nemotron-H's backbone. -> model.)."""
    from backend.model.loader import _canonical as canonical_name

    return (canonical_name(module + ".weight") or module + ".weight").removesuffix(".weight")


@dataclass
class _Served:
    """The adapters engines serve on one model (several engines may share a model: each
    one's adapters stay attached while another loads or unloads its own)."""

    adapters: dict[int, LoraAdapter] = field(default_factory=dict)
    next_index: int = 1  # an unloaded adapter's index is never reused


def _served(model: nn.Module) -> _Served:
    served = getattr(model, "_lora_served", None)
    if served is None:
        served = _Served()
        model._lora_served = served
    return served


def serve(model: nn.Module, adapter: LoraAdapter) -> int:
    """Attaches `adapter` to `model` beside the adapters served on it already, under a new
    index (>= 1, never reused); returns it. Each layer's adapters are replaced by a new
    dict, never edited: a forward running meanwhile (another engine's) sees them all before
    or all after."""
    served = _served(model)
    index, served.next_index = served.next_index, served.next_index + 1
    served.adapters[index] = adapter
    modules = dict(model.named_modules())
    for name, pair in adapter.weights.items():
        linear = modules[name]
        linear.lora = {**(linear.lora or {}), index: pair}
    return index


def withdraw(model: nn.Module, indices) -> None:
    """Detaches the adapters `serve` gave `indices`; the others stay."""
    served = _served(model)
    modules = dict(model.named_modules())
    for index in list(indices):
        adapter = served.adapters.pop(index, None)
        for name in adapter.weights if adapter is not None else ():
            linear = modules[name]
            left = {i: pair for i, pair in (linear.lora or {}).items() if i != index}
            linear.lora = left or None


def attach(model: nn.Module, adapters: Mapping[int, LoraAdapter]) -> None:
    """Gives each targeted layer its adapters' weights under their indices (>= 1),
    replacing what an earlier call attached."""
    from backend.model.linear import Linear

    for _, module in model.named_modules():
        if isinstance(module, Linear):
            module.lora = None
    modules = dict(model.named_modules())
    for index, adapter in adapters.items():
        for name, pair in adapter.weights.items():
            linear = modules[name]
            if linear.lora is None:
                linear.lora = {}
            linear.lora[index] = pair


@dataclass(frozen=True)
class _Batch:
    """Which adapter each row and token of the running forward uses, and (computed once
    a forward, not per layer) where each adapter's rows and tokens are."""

    rows: torch.Tensor  # [B] adapter index per batch row (0: none)
    num_tokens: int  # T: tokens a row in the padded batch
    present: tuple[int, ...]  # the adapters some row uses
    uniform: int  # the adapter of every row when they all share one (0: mixed or none)
    row_index: dict[int, torch.Tensor]  # adapter -> its rows
    token_index: dict[int, torch.Tensor]  # adapter -> its tokens in the flat [B * T]

    @classmethod
    def of(cls, rows: torch.Tensor, num_tokens: int) -> _Batch:
        found = [int(i) for i in rows.unique().tolist()]
        present = tuple(i for i in found if i)
        uniform = found[0] if len(found) == 1 else 0
        row_index, token_index = {}, {}
        if not uniform:
            tokens = rows.repeat_interleave(num_tokens)
            for i in present:
                row_index[i] = (rows == i).nonzero().squeeze(1)
                token_index[i] = (tokens == i).nonzero().squeeze(1)
        return cls(rows, num_tokens, present, uniform, row_index, token_index)


class _Active(threading.local):
    batch: _Batch | None = None


_ACTIVE = _Active()


@contextmanager
def active(rows: torch.Tensor | None, num_tokens: int = 1):
    """Within: a forward over a [B, T] batch (T = `num_tokens`) whose row b uses adapter
    rows[b] (0: the base model)."""
    previous = _ACTIVE.batch
    _ACTIVE.batch = None if rows is None else _Batch.of(rows, num_tokens)
    try:
        yield
    finally:
        _ACTIVE.batch = previous


def delta(lora: dict[int, tuple[torch.Tensor, torch.Tensor]],
          x: torch.Tensor) -> torch.Tensor | None:
    """The low-rank terms a layer adds to its output for input `x` (zero on rows without one
    of its adapters); None when no row of the active batch uses one of them."""
    batch = _ACTIVE.batch
    if batch is None:
        return None
    if batch.uniform:  # every row on one adapter: no rows to pick
        pair = lora.get(batch.uniform)
        return None if pair is None else (x @ pair[0].t()) @ pair[1].t()
    mine = [i for i in batch.present if i in lora]
    if not mine:
        return None
    B = batch.rows.shape[0]
    if x.dim() == 2 and x.shape[0] == B * batch.num_tokens:  # [B * T, in]: every token
        index = batch.token_index
    elif x.dim() > 2 and x.shape[0] == B:  # [B, T, ..., in]
        index = batch.row_index
    else:  # e.g. a subset of the tokens: which row each came from is unknown here
        raise RuntimeError(f"LoRA: an input of shape {tuple(x.shape)} in a batch of "
                           f"{B} rows x {batch.num_tokens} tokens")
    out = x.new_zeros(*x.shape[:-1], lora[mine[0]][1].shape[0])
    for i in mine:
        a, b = lora[i]
        take = index[i]
        out.index_copy_(0, take, (x.index_select(0, take) @ a.t()) @ b.t())
    return out


def apply(lora: dict[int, tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
          y: torch.Tensor) -> torch.Tensor:
    """`y` (= W x) plus the low-rank terms of the rows whose adapter adapts this layer."""
    d = delta(lora, x)
    return y if d is None else y + d


def any_active() -> bool:
    """A forward with some row on an adapter is running (in this thread)."""
    return _ACTIVE.batch is not None and bool(_ACTIVE.batch.present)
