"""Hugging Face-format checkpoint directory (Qwen3.5, Qwen3-Next or Nemotron-H) ->
HybridForCausalLM (memory-mapped safetensors)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from backend.config import QWEN3_NEXT, ModelConfig
from backend.model.decode import FastDecode
from backend.model.hybrid import HybridForCausalLM
from backend.model.linear import pack_linears

# Prefixes real checkpoints put in front of the text model's names (Nemotron-H: backbone.),
# and parts we never load.
_NAME_PREFIXES = ("model.language_model.", "language_model.model.", "backbone.")
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.vision_tower.")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and tensor."""


def _canonical(name: str) -> str | None:
    if name.startswith(_IGNORED_PREFIXES):
        return None
    for prefix in _NAME_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e!r})") from e
        if not isinstance(weight_map, dict) or \
                not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file "
                                  f"names, got {type(weight_map).__name__}")
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return [single]


def _read_tensors(files: list[Path]) -> dict[str, tuple[Path, str]]:
    """Canonical parameter name -> (file, name in file)."""
    found: dict[str, tuple[Path, str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                names = list(st.keys())
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
        for n in names:
            canon = _canonical(n)
            if canon is not None:
                found[canon] = (f, n)
    return found


def _same_tensor(found: dict[str, tuple[Path, str]], a: str, b: str) -> bool:
    """Whether two stored tensors hold the same values (False where one is missing)."""
    if a not in found or b not in found:
        return False
    try:
        tensors = []
        for name in (a, b):
            f, key = found[name]
            with safe_open(str(f), framework="pt") as st:
                tensors.append(st.get_tensor(key))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"unreadable tensor ({e})") from e
    return tensors[0].shape == tensors[1].shape and torch.equal(tensors[0], tensors[1])


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    pack: bool = True,
) -> HybridForCausalLM:
    """Loads config.json + safetensors weights from an HF-format directory. With `pack` (the
    default) the linear layers of a CPU model also keep a oneDNN-packed copy of their weights
    for inference (`backend/model/linear.py`), and a float32 one fused copies of its layers for
    decode steps (`backend/model/decode.py`); the parameters stay the checkpoint's."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file}: missing")
    try:
        cfg = ModelConfig.from_file(cfg_file)
    except (ValueError, FileNotFoundError) as e:
        raise CheckpointError(str(e)) from e
    found = _read_tensors(_weight_files(path))
    embedding = "model.embeddings.weight" if cfg.is_nemotron_h else "model.embed_tokens.weight"
    if cfg.tie_word_embeddings and "lm_head.weight" in found and \
            not _same_tensor(found, "lm_head.weight", embedding):
        # A stored output head of its own is used, as transformers does (Nemotron-H never
        # ties; Qwen3.5 warns and keeps both): tying would drop it and change the logits.
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    with torch.device("meta"):
        model = HybridForCausalLM(cfg)
    expected = {n: p for n, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        found.pop("lm_head.weight", None)
    derived = _qwen3_next_projections(cfg, found) if cfg.model_type == QWEN3_NEXT else {}
    _check_names(path, expected, found)
    state = {}
    handles: dict[Path, object] = {}
    packed = (None, None)  # the last packed tensor read: its parts are consecutive names
    for name, param in expected.items():
        f, key = found[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        if name in derived:  # a part of a packed tensor (Qwen3-Next), read once for all
            if packed[0] != (f, key):
                packed = ((f, key), handles[f].get_tensor(key))
            try:
                tensor = derived[name](packed[1])
            except RuntimeError as e:  # a packed tensor of the wrong size cannot be cut
                raise CheckpointError(f"{f}: tensor {key!r} has shape "
                                      f"{tuple(packed[1].shape)}, which does not cut into this "
                                      f"config's projections ({e})") from None
        else:
            tensor = handles[f].get_tensor(key)
        if not tensor.is_floating_point():  # an integer or bool tensor cast would be garbage
            raise CheckpointError(f"{f}: tensor {key!r} is {tensor.dtype}, not floating point")
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{f}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if model.rotary is not None:  # its tables were built on the meta device
        model.rotary = model.rotary.__class__(cfg.rotary_dim, cfg.rope_theta).to(device)
    if pack:
        pack_linears(model)
        if FastDecode.available(model):
            model.fast_decode = FastDecode(model)
    return model.eval()


def _qwen3_next_projections(cfg: ModelConfig, found: dict) -> dict:
    """Qwen3-Next packs a Gated DeltaNet's input projections per key head: `in_proj_qkvz`
    rows [q_h, k_h, v_h (r heads), z_h (r heads)] for each key head h (r = value heads per
    key head), `in_proj_ba` rows [b_h (r), a_h (r)]. Our layer has Qwen3.5's four
    projections (q of all heads, then k, then v; z; b; a). Points each of those names at its
    packed tensor in `found` and returns name -> function cutting it out of that tensor."""
    Hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r, dv = cfg.linear_num_value_heads // Hk, cfg.linear_value_head_dim

    def qkv(w):
        q, k, v, _ = w.view(Hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], 1)
        return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])

    def z(w):
        return w.view(Hk, 2 * dk + 2 * r * dv, -1)[:, 2 * dk + r * dv:].reshape(-1, w.shape[-1])

    def b(w):
        return w.view(Hk, 2, r, -1)[:, 0].reshape(Hk * r, -1)

    def a(w):
        return w.view(Hk, 2, r, -1)[:, 1].reshape(Hk * r, -1)

    derived = {}
    for packed, parts in (("in_proj_qkvz", (("in_proj_qkv", qkv), ("in_proj_z", z))),
                          ("in_proj_ba", (("in_proj_b", b), ("in_proj_a", a)))):
        suffix = f"linear_attn.{packed}.weight"
        for name in [n for n in found if n.endswith(suffix)]:
            base = name[: -len(f"{packed}.weight")]
            for part, cut in parts:
                found[f"{base}{part}.weight"] = found[name]
                derived[f"{base}{part}.weight"] = cut
            del found[name]
    return derived


def _check_names(path: Path, expected: dict, found: dict) -> None:
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"{path}: missing tensors {missing[:5]}" + (" ..." if len(missing) > 5 else "")
        )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        where = found[unexpected[0]][0]
        raise CheckpointError(
            f"{where}: unexpected tensors {unexpected[:5]}"
            + (" ..." if len(unexpected) > 5 else "")
        )
