"""Paged prefix store for hybrid models: radix tree of pages with KV + anchor sidecar,
look-ahead LRU, reference counts, tenant salts, tier hook and the checkpoint baseline.

The cache never imports the model: it manages ids, the engine owns the tensors.
"""

from __future__ import annotations

from backend.cache.base import (
    DropTier,
    EvictAction,
    EvictDecision,
    InsertResult,
    MatchResult,
    PageAllocation,
    StateCheckpoint,
    Tier,
    TierBackend,
)
from backend.cache.checkpoint import checkpoint_positions
from backend.cache.config import CACHE_POLICIES, CacheConfig
from backend.cache.pools import PagePool
from backend.cache.radix import PageNode, RadixTree, encode_tokens
from backend.cache.stats import CacheStats
from backend.cache.store import PrefixStore

__all__ = [
    "CACHE_POLICIES",
    "CacheConfig",
    "CacheStats",
    "DropTier",
    "EvictAction",
    "EvictDecision",
    "InsertResult",
    "MatchResult",
    "PageAllocation",
    "PageNode",
    "PagePool",
    "PrefixStore",
    "RadixTree",
    "StateCheckpoint",
    "Tier",
    "TierBackend",
    "checkpoint_positions",
    "encode_tokens",
]
