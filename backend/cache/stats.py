"""Counters of the prefix store, exported by the server as metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from backend.cache.base import Tier

# Eviction reasons: the pool was short when a caller asked for ids, or `evict()` was called.
CAPACITY = "capacity"
EXPLICIT = "explicit"
# A checkpoint dropped because the page carrying it left the device.
WITH_PAGE = "with_page"
# Dropped by a prefix cache reset (`PrefixStore.reset`).
RESET = "reset"
# Reported from the start (at 0): every reason's series exists before its first eviction.
PAGE_EVICTION_REASONS = (CAPACITY, EXPLICIT, RESET)
CHECKPOINT_EVICTION_REASONS = (CAPACITY, EXPLICIT, WITH_PAGE, RESET)


@dataclass
class CacheStats:
    """Monotonic counters (tokens for hits, pages for inserts and evictions)."""

    num_match_requests: int = 0
    num_queried_tokens: int = 0
    hit_tokens_by_tier: Counter[Tier] = field(default_factory=Counter)
    pages_inserted: int = 0
    page_evictions_by_reason: Counter[str] = field(default_factory=Counter)
    pages_demoted: int = 0
    pages_promoted: int = 0
    checkpoints_inserted: int = 0
    checkpoint_evictions_by_reason: Counter[str] = field(default_factory=Counter)
    protected_pages_passed_over: int = 0
    # Device pages above the default retention priority evicted (nothing lower could go).
    retained_page_evictions: int = 0
    # Live states made first to go by a deeper state on their path (`Evictor.shadow_states`).
    shadowed_states: int = 0

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_tokens_by_tier.values())

    @property
    def checkpoint_evictions(self) -> int:
        return sum(self.checkpoint_evictions_by_reason.values())

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready view (tier names lower-case)."""
        return {
            "num_match_requests": self.num_match_requests,
            "num_queried_tokens": self.num_queried_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_tokens_by_tier": {t.name.lower(): self.hit_tokens_by_tier[t] for t in Tier},
            "pages_inserted": self.pages_inserted,
            "page_evictions_by_reason": {**dict.fromkeys(PAGE_EVICTION_REASONS, 0),
                                         **self.page_evictions_by_reason},
            "pages_demoted": self.pages_demoted,
            "pages_promoted": self.pages_promoted,
            "checkpoints_inserted": self.checkpoints_inserted,
            "checkpoint_evictions_by_reason": {
                **dict.fromkeys(CHECKPOINT_EVICTION_REASONS, 0),
                **self.checkpoint_evictions_by_reason},
            "protected_pages_passed_over": self.protected_pages_passed_over,
            "retained_page_evictions": self.retained_page_evictions,
            "shadowed_states": self.shadowed_states,
        }
