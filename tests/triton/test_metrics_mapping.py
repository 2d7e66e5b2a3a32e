"""engine.stats() -> metric samples (no server)."""

from __future__ import annotations

from backend.triton.metrics import FAMILIES, KV_BLOCKS, REQUESTS, samples

STATS = {
    "page_size": 64,
    "kv_pages_total": 100,
    "kv_pages_free": 75,
    "kv_pages_used": 25,
    "max_num_seqs": 8,
    "active_requests": 2,
    "waiting_requests": 3,
    "replayed_anchors": 11,
    "memory_bytes": {"device_kv": 1 << 20, "device_anchors": 4096, "host": 0},
    "cache": {
        "hit_tokens": 640,
        "hit_tokens_by_tier": {"device": 512, "host": 128, "ssd": 0},
        "page_evictions_by_reason": {"capacity": 4},
    },
    "tiers": {"ssd_bytes_read": 4096, "prefetch_hits": 3, "prefetch_started": 5,
              "chunk_rejects": {"checksum": 1}},
    "label": "not a number",
    "lora_adapters": ["tutor", "v1.2"],
    "lora_requests": {"tutor": 5, "v1.2": 0},
    "lora_running": {"tutor": 2, "v1.2": 0},
}


def by_key() -> dict:
    return {(s.family, s.labels): s.value for s in samples(STATS)}


def test_tensorrt_llm_families():
    got = by_key()
    assert got[(KV_BLOCKS, (("kv_cache_block_type", "max"),))] == 100
    assert got[(KV_BLOCKS, (("kv_cache_block_type", "tokens_per"),))] == 64
    assert got[(KV_BLOCKS, (("kv_cache_block_type", "fraction"),))] == 0.25
    assert got[(KV_BLOCKS, (("kv_cache_block_type", "reused"),))] == 10
    assert got[(REQUESTS, (("request_type", "active"),))] == 5
    assert got[(REQUESTS, (("request_type", "scheduled"),))] == 2
    assert got[(REQUESTS, (("request_type", "max"),))] == 8


def test_ours_by_label_and_missing_keys_skipped():
    got = by_key()
    assert got[("suffixreplay_hit_tokens_total", (("tier", "host"),))] == 128
    evictions = ("suffixreplay_evictions_total", (("tier", "device"), ("reason", "capacity")))
    assert got[evictions] == 4
    assert got[("suffixreplay_ssd_bytes_total", (("direction", "read"),))] == 4096
    assert got[("suffixreplay_prefetch_total", (("result", "hit"),))] == 3
    # Reads the prefetcher started: their own family, not one of the demand results.
    assert got[("suffixreplay_prefetch_started_total", ())] == 5
    assert ("suffixreplay_prefetch_total", (("result", "started"),)) not in got
    assert got[("suffixreplay_ssd_chunk_rejects_total", (("reason", "checksum"),))] == 1
    assert got[("suffixreplay_replayed_anchors_total", ())] == 11
    assert got[("suffixreplay_memory_bytes", (("pool", "device_kv"),))] == 1 << 20
    assert got[("suffixreplay_memory_bytes", (("pool", "device_anchors"),))] == 4096
    families = {family for family, _ in got}
    assert "suffixreplay_checksum_failures_total" not in families  # not in these stats
    assert families <= set(FAMILIES)


def test_lora_adapters_by_name():
    got = by_key()
    assert got[("suffixreplay_lora_requests_total", (("adapter", "tutor"),))] == 5
    assert got[("suffixreplay_lora_requests_total", (("adapter", "v1.2"),))] == 0
    assert got[("suffixreplay_lora_running_requests", (("adapter", "tutor"),))] == 2


def test_every_reason_series_exists_before_its_first_event():
    """A fresh store's stats give each eviction and chunk-reject reason at 0 (dashboards and
    rate() find the series from the start, not after the first eviction)."""
    from backend.cache.stats import CHECKPOINT_EVICTION_REASONS, PAGE_EVICTION_REASONS, CacheStats
    from backend.cache.tier_stats import CHUNK_REJECT_REASONS, TierStats

    got = {(s.family, s.labels): s.value
           for s in samples({"cache": CacheStats().as_dict(), "tiers": TierStats().as_dict()})}
    for reason in PAGE_EVICTION_REASONS:
        key = ("suffixreplay_evictions_total", (("tier", "device"), ("reason", reason)))
        assert got[key] == 0, key
    for reason in CHECKPOINT_EVICTION_REASONS:
        assert got[("suffixreplay_checkpoint_evictions_total", (("reason", reason),))] == 0
    for reason in CHUNK_REJECT_REASONS:
        assert got[("suffixreplay_ssd_chunk_rejects_total", (("reason", reason),))] == 0
    for tier in ("device", "host", "ssd"):
        assert got[("suffixreplay_hit_tokens_total", (("tier", tier),))] == 0


def test_every_mapped_family_is_declared():
    """Each family that a stats key maps to has its description and kind (EngineMetrics
    creates the families from FAMILIES, and a sample of an undeclared one would stop the
    refresh at it)."""
    from backend.triton.metrics import BY_LABEL, SCALARS

    mapped = {name for name, *_ in SCALARS} | {name for name, *_ in BY_LABEL}
    assert mapped - set(FAMILIES) == set()


def test_a_fresh_engines_cache_stats_give_every_cache_family():
    """Each counter of CacheStats reaches its family, at 0 before any event (the shadowed
    live states among them)."""
    from backend.cache.stats import CacheStats

    got = {s.family: s.value for s in samples({"cache": CacheStats().as_dict()})}
    assert got["suffixreplay_shadowed_states_total"] == 0
    assert got["suffixreplay_retained_evictions_total"] == 0
    assert {s.family for s in samples({"cache": CacheStats().as_dict()})} <= set(FAMILIES)
