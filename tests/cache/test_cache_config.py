from __future__ import annotations

import dataclasses

import pytest

from backend.cache import CacheConfig


def test_defaults():
    cfg = CacheConfig()
    assert (cfg.page_size, cfg.policy, cfg.checkpoint_interval) == (64, "suffixreplay", 256)
    assert cfg.anchors_per_page == 4 and cfg.anchor_pool_size == cfg.num_kv_pages
    assert CacheConfig(policy="checkpoint").anchor_pool_size == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(page_size=0), "page_size"),
        (dict(policy="lru"), "'lru'"),
        (dict(checkpoint_interval=100), "checkpoint_interval=100"),
        (dict(num_kv_pages=0), "num_kv_pages"),
        (dict(num_anchor_blocks=0), "num_anchor_blocks=0"),
        (dict(num_checkpoint_slots=-1), "-1"),
        (dict(lookahead_window=-2), "-2"),
        (dict(anchor_density=0.3), "anchor_density=0.3"),
        (dict(anchor_density=0.0), "anchor_density=0.0"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)
