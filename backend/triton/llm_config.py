"""hybrid_llm's config.pbtxt parameters: our serving keys here, the rest go to the engine.

Serving keys (all optional):
  model_path: the model's HF folder, absolute or relative to the model's own folder
    (default `1/tiny_qwen3_5`);
  calibration_path: the calibration.json that `k_max` / `anchor_density: auto` read, absolute
    or relative to the model's own folder (default: the one in model_path; `engine_build.build
    --calibrate` writes `1/calibration.json` into the repository it builds);
  exclude_input_in_output: default when a request does not say (TensorRT-LLM's parameter);
  stats_check_period_ms: how often metrics are refreshed from `engine.stats()` (TensorRT-LLM's);
  cancellation_check_period_ms: how often open requests are polled for cancellation (same);
  guided_decoding_backend: `xgrammar` (default; loaded in the background when the model loads,
    so the first guided request does not wait for it) or `none` (guided requests are
    INVALID_ARG), TensorRT-LLM's parameter.
  allow_runtime_lora: `true` lets requests with `load_lora` / `unload_lora` add and remove
    LoRA adapters while the model serves (default `false`: they are INVALID_ARG; an adapter
    path is read from the server's disk).
Every other key is handed to `EngineConfig.from_params`, which rejects unknown keys. An empty
value or an unfilled `${...}` template counts as unset, as in TensorRT-LLM's templates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.triton.errors import ConfigError
from backend.triton.params import get_bool_param, get_param

DEFAULT_MODEL_PATH = "1/tiny_qwen3_5"
SERVING_KEYS = (
    "model_path",
    "calibration_path",
    "exclude_input_in_output",
    "stats_check_period_ms",
    "cancellation_check_period_ms",
    "guided_decoding_backend",
    "allow_runtime_lora",
)
GUIDED_BACKENDS = ("xgrammar", "none")


@dataclass(frozen=True)
class ServingSettings:
    model_path: Path
    calibration_path: Path | None = None
    exclude_input_in_output: bool = True
    stats_check_period_ms: int = 100
    cancellation_check_period_ms: int = 100
    guided_decoding_backend: str = "xgrammar"
    allow_runtime_lora: bool = False

    def __post_init__(self) -> None:
        if self.guided_decoding_backend not in GUIDED_BACKENDS:
            raise ConfigError(f"parameter guided_decoding_backend must be one of "
                              f"{', '.join(GUIDED_BACKENDS)}, got "
                              f"{self.guided_decoding_backend!r}")
        for name in ("stats_check_period_ms", "cancellation_check_period_ms"):
            value = getattr(self, name)
            if not 1 <= value <= 60_000:
                raise ConfigError(f"parameter {name} must be in [1, 60000] ms, got {value}")


def serving_settings(config: Mapping[str, Any], model_dir: Path) -> ServingSettings:
    """Our keys from the model config dict; `model_dir` is the model's own folder."""
    raw_path = get_param(config, "model_path", DEFAULT_MODEL_PATH)
    assert raw_path is not None
    path = Path(raw_path).expanduser()
    path = path if path.is_absolute() else model_dir / path
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"parameter model_path={raw_path!r}: no model at {path} (config.json missing)"
        )
    raw_calib = get_param(config, "calibration_path")
    calibration = None
    if raw_calib is not None:
        calibration = Path(raw_calib).expanduser()
        calibration = calibration if calibration.is_absolute() else model_dir / calibration
        if not calibration.is_file():
            raise ConfigError(f"parameter calibration_path={raw_calib!r}: no file at "
                              f"{calibration}")
    return ServingSettings(
        model_path=path,
        calibration_path=calibration,
        exclude_input_in_output=get_bool_param(config, "exclude_input_in_output", True),
        stats_check_period_ms=_int_param(config, "stats_check_period_ms", 100),
        cancellation_check_period_ms=_int_param(config, "cancellation_check_period_ms", 100),
        guided_decoding_backend=str(get_param(config, "guided_decoding_backend",
                                              "xgrammar")).lower(),
        allow_runtime_lora=get_bool_param(config, "allow_runtime_lora", False),
    )


def engine_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The parameters meant for `EngineConfig.from_params` (set ones only)."""
    keys = config.get("parameters", {}).keys()
    params = {key: get_param(config, key) for key in keys if key not in SERVING_KEYS}
    return {key: value for key, value in params.items() if value is not None}


def _int_param(config: Mapping[str, Any], key: str, default: int) -> int:
    value = get_param(config, key)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"parameter {key} must be an integer, got {value!r}") from None
