"""`family_model`: the engine suites' model, once per family of `engine_helpers.FAMILIES`;
a module sets `CHECKPOINT = (seed, slow_decay)` for its random checkpoint. `hf` / `engine`:
the trained default model in transformers (the oracle) and in an engine of the default
configuration (a module may define its own `engine`)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import FAMILIES, TINY_MODEL_DIR, family_checkpoint

from backend.engine import Engine, EngineConfig
from backend.model import load_model


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    seed, slow_decay = getattr(request.module, "CHECKPOINT", (0, False))
    path = tmp_path_factory.mktemp(f"{request.module.__name__}-{request.param}")
    family_checkpoint(path, request.param, seed=seed, slow_decay=slow_decay)
    return load_model(path)


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_model_dir(TINY_MODEL_DIR, EngineConfig())
