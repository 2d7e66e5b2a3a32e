"""`family_model`: the engine suites' model, once per family of `engine_helpers.FAMILIES`;
a module sets `CHECKPOINT = (seed, slow_decay)` for its random checkpoint."""

from __future__ import annotations

import pytest
from engine_helpers import FAMILIES, family_checkpoint

from backend.model import load_model


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    seed, slow_decay = getattr(request.module, "CHECKPOINT", (0, False))
    path = tmp_path_factory.mktemp(f"{request.module.__name__}-{request.param}")
    family_checkpoint(path, request.param, seed=seed, slow_decay=slow_decay)
    return load_model(path)
