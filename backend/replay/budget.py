"""How many anchors a hit replays: k = min(ceil(fraction * n), k_max)."""

from __future__ import annotations

import math
from dataclasses import dataclass

SAMPLINGS = ("dense_tail", "uniform")
ANCHOR_DTYPES = ("model", "int8")


@dataclass(frozen=True)
class ReplayConfig:
    """Anchor density and sampling, replay budget, anchor storage dtype.

    Exact mode (`ReplayConfig.exact()`): every token is an anchor and every anchor before the
    boundary is replayed, so replay reproduces a full prefill's states.
    """

    anchor_density: float = 1 / 16
    sampling: str = "dense_tail"
    budget_fraction: float = 0.05
    k_max: int | None = 512  # None: unbounded
    anchor_dtype: str = "model"
    live_state: bool = True
    # Resume from a live state short of the match end (recomputing the pages after it)
    # instead of replaying at the match end when that costs less, in recomputed-token units:
    # a replay costs replay_fixed_tokens + replay_anchor_tokens x k; a token recomputed at
    # context c costs 1 + c / recompute_context_tokens (`recompute_is_cheaper`). Defaults
    # measured with the default model on the development CPU, on the engine thread (its
    # OpenMP pool the process's only one: backend/openmp.py), where a replay's eager passes
    # over the groups cost ~4.3 ms whatever k, an anchor ~0.064 ms more and a token 0.153 ms
    # at context 0, 0.17 / 0.23 / 0.34 ms at 2K / 8K / 16K (docs/gpu.md); 0 and 0 turn it off.
    replay_fixed_tokens: float = 28.0
    replay_anchor_tokens: float = 0.41
    recompute_context_tokens: float = 15_000.0
    # k_max / the anchor density come from the model's calibration.json when the engine is
    # built from a model directory (`k_max: auto` / `anchor_density: auto` in the serving
    # configuration).
    k_max_auto: bool = False
    anchor_density_auto: bool = False

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction}")
        if self.k_max is not None and self.k_max < 1:
            raise ValueError(f"k_max must be >= 1 or None, got {self.k_max}")
        if self.anchor_dtype not in ANCHOR_DTYPES:
            raise ValueError(
                f"anchor_dtype must be one of {ANCHOR_DTYPES}, got {self.anchor_dtype!r}"
            )
        if not 0 < self.anchor_density <= 1:
            raise ValueError(f"anchor_density must be in (0, 1], got {self.anchor_density}")
        for name in ("replay_fixed_tokens", "replay_anchor_tokens"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if not self.recompute_context_tokens > 0:
            raise ValueError("recompute_context_tokens must be > 0, got "
                             f"{self.recompute_context_tokens}")

    @classmethod
    def exact(cls) -> ReplayConfig:
        return cls(anchor_density=1.0, budget_fraction=1.0, k_max=None)


def replay_budget(num_tokens: int, config: ReplayConfig, num_available: int) -> int:
    """Anchors to replay for a hit of `num_tokens` tokens with `num_available` anchors."""
    if num_tokens <= 0:
        return 0
    k = math.ceil(config.budget_fraction * num_tokens - 1e-9)
    if config.k_max is not None:
        k = min(k, config.k_max)
    return max(1, min(k, num_available))


def recompute_is_cheaper(distance: int, context: int, anchors: int,
                         config: ReplayConfig) -> bool:
    """Whether recomputing `distance` tokens (ending at `context`) from an exact live state
    costs no more than replaying `anchors` anchors (`ReplayConfig`'s cost model). Ties go to
    the live state: it is exact, a replay of a bounded suffix approximates."""
    recompute = distance * (1 + context / config.recompute_context_tokens)
    return recompute <= config.replay_fixed_tokens + config.replay_anchor_tokens * anchors
