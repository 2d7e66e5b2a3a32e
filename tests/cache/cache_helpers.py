"""Builders shared by the cache tests: small stores and a "run one request" helper.

Imported as `from cache_helpers import ...` (pytest puts this folder on sys.path).
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.cache import CacheConfig, InsertResult, PrefixStore, TierBackend


def make_store(tier: TierBackend | None = None, **overrides) -> PrefixStore:
    """A small store: 4-token pages, one anchor per page, 16 KV pages, 4 checkpoint slots."""
    fields = dict(
        page_size=4,
        anchor_density=0.25,
        checkpoint_interval=8,
        num_kv_pages=16,
        num_checkpoint_slots=4,
        lookahead_window=2,
    )
    fields.update(overrides)
    return PrefixStore(CacheConfig(**fields), tier)


def cache_tokens(
    store: PrefixStore,
    tokens: Sequence[int],
    salt: str | None = None,
    with_states: bool = True,
) -> InsertResult | None:
    """What the engine does for one request: match, allocate the missing pages (and, under the
    checkpoint policy, slots at `checkpoint_positions`), insert, free the duplicates. Returns
    None when the pools cannot make room."""
    match = store.match_prefix(tokens, salt)
    # Lock first: allocation may evict, and it must not take the pages just matched.
    store.lock(match.nodes)
    num_pages = len(tokens) // store.page_size
    alloc = store.alloc_pages(num_pages - match.num_matched_pages)
    if alloc is None:
        store.unlock(match.nodes)
        return None
    states: dict[int, int] = {}
    positions = store.checkpoint_positions(len(tokens), match.num_matched_tokens)
    if with_states and positions:
        slots = store.alloc_state_slots(len(positions))
        if slots is not None:
            states = dict(zip(positions, slots))
    result = store.insert(
        tokens,
        salt,
        match.kv_pages + alloc.kv_pages,
        match.anchor_blocks + alloc.anchor_blocks,
        states,
    )
    store.unlock(match.nodes)
    store.free_pages(result.duplicate_kv_pages, result.duplicate_anchor_blocks)
    store.free_state_slots(result.duplicate_state_slots)
    return result


def pages(*chunks: int, page_size: int = 4) -> list[int]:
    """Tokens of pages whose every token is the chunk id: pages(1, 2) -> [1,1,1,1,2,2,2,2]."""
    return [c for c in chunks for _ in range(page_size)]
