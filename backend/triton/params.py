"""Reading and validating config.pbtxt `parameters` of the Python-backend models."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from backend.tokenizer import Tokenizer, load_tokenizer
from backend.triton.errors import ConfigError

DEFAULT_TOKENIZER_DIR = "hybrid_llm/1/tiny_qwen3_5"
_TRUE = ("true", "1", "yes", "y", "t", "on")
_FALSE = ("false", "0", "no", "n", "f", "off")


def parse_model_config(args: Mapping[str, str]) -> dict[str, Any]:
    """The model config dict from the `args` that Triton passes to `initialize`."""
    try:
        return json.loads(args["model_config"])
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"cannot read the model config from the backend: {exc}") from exc


def get_param(config: Mapping[str, Any], key: str, default: str | None = None) -> str | None:
    """A string parameter; empty or an unfilled template (`${key}`, as TRT-LLM ships) is unset."""
    entry = config.get("parameters", {}).get(key)
    value = entry.get("string_value", "") if isinstance(entry, dict) else ""
    value = value.strip()
    if not value or (value.startswith("${") and value.endswith("}")):
        return default
    return value


def get_bool_param(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = get_param(config, key)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"parameter {key} must be true or false, got {value!r}")


def repository_root(args: Mapping[str, str]) -> Path:
    """The model repository folder: the parent of the model's own folder.

    The Python backend's `args["model_repository"]` is the model's folder, not the repository.
    """
    try:
        return Path(args["model_repository"]).resolve().parent
    except KeyError:
        raise ConfigError("the backend did not pass model_repository") from None


def resolve_tokenizer_dir(value: str, repo_root: Path) -> Path:
    """Absolute paths stay; relative ones are taken from the model repository root."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else repo_root / path


def load_tokenizer_param(config: Mapping[str, Any], args: Mapping[str, str]) -> Tokenizer:
    """Load the tokenizer named by the `tokenizer_dir` parameter (default: the tiny model's)."""
    value = get_param(config, "tokenizer_dir", DEFAULT_TOKENIZER_DIR)
    assert value is not None
    path = resolve_tokenizer_dir(value, repository_root(args))
    try:
        tokenizer = load_tokenizer(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"parameter tokenizer_dir={value!r}: {exc}") from exc
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"parameter tokenizer_dir={value!r}: tokenizer at {path} has no end-of-sequence "
            "token; add a tokenizer_config.json with eos_token"
        )
    return tokenizer
