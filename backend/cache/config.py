"""`CacheConfig`: sizes and policy of the paged prefix store (re-exported by `backend.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CachePolicy = Literal["suffixreplay", "checkpoint", "none"]
CACHE_POLICIES: tuple[str, ...] = ("suffixreplay", "checkpoint", "none")
CHECKPOINT_PLACEMENTS: tuple[str, ...] = ("grid", "sglang")


@dataclass(frozen=True)
class CacheConfig:
    """What the prefix store holds and how it chooses.

    page_size: tokens per page (one radix node). policy: "suffixreplay" (every page carries
    anchors, a hit may end at any page boundary), "checkpoint" (SGLang / TensorRT-LLM style
    baseline: full linear states every `checkpoint_interval` tokens and at prompt ends; a hit
    ends at the deepest checkpoint) or "none" (never hits). Where the checkpoint policy saves
    states is `checkpoint_placement` (`backend/cache/checkpoint.py`): "grid" (every
    `checkpoint_interval` tokens of a prefill and at prompt ends) or "sglang" (as SGLang's
    mamba radix cache with its extra buffer: one state per prefill chunk of
    `checkpoint_prefill_chunk` tokens, at the request's branch point or the chunk's end, and
    every `checkpoint_interval` tokens of decode). Pool sizes are counts of ids:
    one KV page covers all attention layers of one page, one anchor block covers all groups
    of one page, one checkpoint slot covers the states of all linear layers.
    `num_anchor_blocks=None` means "as many as KV pages" under suffixreplay and 0 otherwise.
    `lookahead_window` is W of PCR's look-ahead LRU (0 = plain LRU).
    `shadowed_states_first` (suffixreplay only): once a request saves a state past where it
    resumed, the state it resumed from is evicted before the others unless two requests
    resumed from it (`PrefixStore.shadow_states`); False is plain LRU over states.
    `max_cached_pages` caps the device KV pages the cache keeps for prefixes that no running
    request holds (None: the whole pool): the rest of the pool stays free for running
    requests, and a cache budget in bytes means what it says (benchmarks).
    """

    page_size: int = 64
    policy: CachePolicy = "suffixreplay"
    checkpoint_interval: int = 256
    checkpoint_placement: str = "grid"
    checkpoint_prefill_chunk: int = 8192
    num_kv_pages: int = 4096
    num_anchor_blocks: int | None = None
    num_checkpoint_slots: int = 16
    lookahead_window: int = 6
    anchor_density: float = 1 / 16
    max_cached_pages: int | None = None
    shadowed_states_first: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.policy not in CACHE_POLICIES:
            raise ValueError(f"policy must be one of {CACHE_POLICIES}, got {self.policy!r}")
        if self.checkpoint_interval < 1 or self.checkpoint_interval % self.page_size:
            raise ValueError(
                f"checkpoint_interval={self.checkpoint_interval} must be a positive multiple "
                f"of page_size={self.page_size}"
            )
        if self.checkpoint_placement not in CHECKPOINT_PLACEMENTS:
            raise ValueError(f"checkpoint_placement must be one of {CHECKPOINT_PLACEMENTS}, "
                             f"got {self.checkpoint_placement!r}")
        if self.checkpoint_prefill_chunk < 1 or self.checkpoint_prefill_chunk % self.page_size:
            raise ValueError(
                f"checkpoint_prefill_chunk={self.checkpoint_prefill_chunk} must be a positive "
                f"multiple of page_size={self.page_size}"
            )
        if self.num_kv_pages < 1:
            raise ValueError(f"num_kv_pages must be >= 1, got {self.num_kv_pages}")
        if self.num_anchor_blocks is not None and self.num_anchor_blocks < 0:
            raise ValueError(f"num_anchor_blocks must be >= 0, got {self.num_anchor_blocks}")
        if self.policy == "suffixreplay" and self.anchor_pool_size < 1:
            raise ValueError(
                f"policy 'suffixreplay' needs anchor blocks, got num_anchor_blocks="
                f"{self.num_anchor_blocks}"
            )
        if self.num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0, got {self.num_checkpoint_slots}")
        if self.policy == "checkpoint" and self.num_checkpoint_slots < 1:
            raise ValueError("policy 'checkpoint' resumes from the states it keeps in "
                             "num_checkpoint_slots: it must be >= 1 (0 never hits)")
        if self.max_cached_pages is not None and self.max_cached_pages < 0:
            raise ValueError(f"max_cached_pages must be >= 0, got {self.max_cached_pages}")
        if self.lookahead_window < 0:
            raise ValueError(f"lookahead_window must be >= 0, got {self.lookahead_window}")
        per_page = self.anchor_density * self.page_size
        if not 0 < self.anchor_density <= 1 or abs(per_page - round(per_page)) > 1e-9:
            raise ValueError(
                f"anchor_density={self.anchor_density} must be in (0, 1] and give a whole "
                f"number of anchors per page of {self.page_size} tokens (got {per_page})"
            )

    @property
    def anchor_pool_size(self) -> int:
        if self.num_anchor_blocks is not None:
            return self.num_anchor_blocks
        return self.num_kv_pages if self.policy == "suffixreplay" else 0

    @property
    def uses_anchors(self) -> bool:
        return self.policy == "suffixreplay"

    @property
    def anchors_per_page(self) -> int:
        return round(self.anchor_density * self.page_size)
