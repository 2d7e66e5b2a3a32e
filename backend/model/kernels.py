"""Which gated-delta-rule implementation runs: flash-linear-attention's Triton kernels on CUDA
where the `fla` package is installed (the `[gpu]` extra), else this package's PyTorch forms.

`fla` is imported only when a CUDA tensor asks for it, so CPU machines never import it (and
never need it installed). Both take q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H] and an
initial state [B, H, K, V] and return (o, final state); padded positions carry g = 0 and
beta = 0 and leave the state untouched in both.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from backend.model.delta_rule import chunk_gated_delta_rule, gated_delta_step


@lru_cache(maxsize=1)
def fla_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


def delta_rule_for(x: torch.Tensor, num_tokens: int):
    """The implementation for tensors like `x` and a forward of `num_tokens` tokens."""
    if x.is_cuda and fla_available():
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule as fla_chunk,
        )
        from fla.ops.gated_delta_rule import (
            fused_recurrent_gated_delta_rule as fla_recurrent,
        )

        fn = fla_recurrent if num_tokens == 1 else fla_chunk

        def run(q, k, v, g, beta, initial_state=None, scale=None):
            o, final = fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=True)
            return o, final.float()

        return run
    return gated_delta_step if num_tokens == 1 else chunk_gated_delta_rule
