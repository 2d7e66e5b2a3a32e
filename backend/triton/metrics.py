"""Prometheus metrics of `hybrid_llm`, refreshed from `engine.stats()` on Triton's metrics port.

TensorRT-LLM's families with its labels (plus `model` and `version`, as it adds them):
  nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|fraction|reused}
  nv_trt_llm_request_metrics{request_type=active|max|scheduled|context|waiting}
A KV "block" is one of our pages. Ours, `suffixreplay_*`: prefix-store hit tokens by tier,
replayed anchors, recomputed tokens, live-state hits, evictions by tier and reason, page-pool use
by state, bytes in use by pool and tier, prefetch reads started and their hits / late /
misses, admissions deferred for reads, SSD bytes read / written, checksum failures and other
SSD chunk rejects. A metric
appears once `engine.stats()` reports its key (tiers and the prefetcher report only when
configured).

`samples(stats)` is the pure mapping (unit-tested); `EngineMetrics` owns the pb_utils objects.
Counters are fed the increase since the previous refresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

GAUGE, COUNTER = "gauge", "counter"
KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
REQUESTS = "nv_trt_llm_request_metrics"

FAMILIES: dict[str, tuple[str, str]] = {
    KV_BLOCKS: ("TRT LLM KV cache block metrics (a block is one KV page)", GAUGE),
    REQUESTS: ("TRT LLM request metrics", GAUGE),
    "suffixreplay_kv_pages": ("KV pages of the device pool by state", GAUGE),
    "suffixreplay_hit_tokens_total": (
        "Prompt tokens served from the prefix store, by tier",
        COUNTER,
    ),
    "suffixreplay_queried_tokens_total": ("Prompt tokens looked up in the prefix store", COUNTER),
    "suffixreplay_replayed_anchors_total": ("Anchors replayed to rebuild linear states", COUNTER),
    "suffixreplay_recomputed_tokens_total": (
        "Prompt tokens prefilled (not served from cache)",
        COUNTER,
    ),
    "suffixreplay_live_state_hits_total": ("Hits resumed from resident live states", COUNTER),
    "suffixreplay_evictions_total": ("Pages evicted, by tier and reason", COUNTER),
    "suffixreplay_checkpoint_evictions_total": ("State checkpoints evicted, by reason", COUNTER),
    "suffixreplay_prefetch_total": (
        "SSD pages read for scheduled requests, by result (hit = prefetched in time, late = "
        "prefetch still in flight, miss = read on demand)",
        COUNTER,
    ),
    "suffixreplay_prefetch_started_total": (
        "SSD -> DRAM page reads started by the prefetcher for queued requests",
        COUNTER,
    ),
    "suffixreplay_deferred_admissions_total": (
        "Steps a queued request waited for its SSD reads while others ran",
        COUNTER,
    ),
    "suffixreplay_prefill_waits_total": (
        "Steps a queued request waited for a running request's prefill of its prompt's pages",
        COUNTER,
    ),
    "suffixreplay_guided_forced_tokens_total": (
        "Output tokens a guide forced, appended without a decode step each (jump-forward)",
        COUNTER,
    ),
    "suffixreplay_spec_decode_tokens_total": (
        "Speculative decoding: draft tokens verified (kind=draft) and kept (kind=accepted); "
        "each kept token is one output token without a step of its own",
        COUNTER,
    ),
    "suffixreplay_spec_corpus_drafts_total": (
        "Speculative decoding (suffix): drafts taken from earlier requests' outputs rather "
        "than the sequence's own tokens",
        COUNTER,
    ),
    "suffixreplay_beam_forks_total": (
        "Beam search: beams that took another beam's history (its run states and the pages "
        "the prefix store does not share copied)",
        COUNTER,
    ),
    "suffixreplay_beam_copied_pages_total": (
        "Beam search: KV pages copied for forked beams",
        COUNTER,
    ),
    "suffixreplay_ssd_bytes_total": ("Bytes moved to and from the SSD tier", COUNTER),
    "suffixreplay_memory_bytes": (
        "Bytes in use by pool: device KV pages, anchor blocks and saved states, DRAM tier "
        "slots (host), SSD tier files (ssd)",
        GAUGE,
    ),
    "suffixreplay_checkpoint_state_tier_total": (
        "Saved states below the device (checkpoints; suffix replay's live states), by event",
        COUNTER,
    ),
    "suffixreplay_checksum_failures_total": ("SSD chunks rejected by their checksum", COUNTER),
    "suffixreplay_ssd_chunk_rejects_total": ("SSD chunks refused (a miss), by reason", COUNTER),
    "suffixreplay_requests_total": ("Requests finished by the engine", COUNTER),
    "suffixreplay_unfinished_requests_total": (
        "Requests ended early: cancelled (a client that left, a stop request) or failed",
        COUNTER,
    ),
    "suffixreplay_retained_evictions_total": (
        "Device pages above the default retention priority evicted because nothing of a lower "
        "priority could go (the retained pages outgrew the pool)",
        COUNTER,
    ),
    "suffixreplay_shadowed_states_total": (
        "Live states put first in line for eviction because a deeper state was saved on "
        "their path (suffix replay: a chat turn's state once the next turn saved its own)",
        COUNTER,
    ),
    "suffixreplay_rejected_requests_total": (
        "Requests refused before queueing: the queue held max_queue_size requests", COUNTER),
    "suffixreplay_preemptions_total": (
        "Requests preempted (recomputed) for lack of pages or for a more urgent request",
        COUNTER,
    ),
    "suffixreplay_lora_requests_total": (
        "Requests submitted on each LoRA adapter (lora_adapters)", COUNTER),
    "suffixreplay_lora_running_requests": (
        "Requests running (admitted) on each LoRA adapter", GAUGE),
    "suffixreplay_prefix_cache_resets_total": (
        "Prefix cache resets (reset_prefix_cache requests); the pages they dropped are "
        "suffixreplay_evictions_total{reason=\"reset\"}",
        COUNTER,
    ),
}

# Where the tiered store's counters sit in engine.stats() (TierStats.as_dict()); the first
# prefix present wins, so a flat layout works too.
TIER_PREFIXES = ("tiers.", "tier.", "")

# (family, labels, stats key); keys of nested dicts are joined with ".". A key starting with
# "tier:" is looked up under each of TIER_PREFIXES.
SCALARS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    (KV_BLOCKS, (("kv_cache_block_type", "max"),), "kv_pages_total"),
    (KV_BLOCKS, (("kv_cache_block_type", "free"),), "kv_pages_free"),
    (KV_BLOCKS, (("kv_cache_block_type", "used"),), "kv_pages_used"),
    (KV_BLOCKS, (("kv_cache_block_type", "tokens_per"),), "page_size"),
    (REQUESTS, (("request_type", "max"),), "max_num_seqs"),
    (REQUESTS, (("request_type", "scheduled"),), "active_requests"),
    (REQUESTS, (("request_type", "context"),), "context_requests"),
    (REQUESTS, (("request_type", "waiting"),), "waiting_requests"),
    ("suffixreplay_kv_pages", (("state", "total"),), "kv_pages_total"),
    ("suffixreplay_kv_pages", (("state", "free"),), "kv_pages_free"),
    ("suffixreplay_kv_pages", (("state", "used"),), "kv_pages_used"),
    ("suffixreplay_kv_pages", (("state", "held_by_requests"),), "kv_pages_held_by_requests"),
    ("suffixreplay_kv_pages", (("state", "cached"),), "cached_pages"),
    ("suffixreplay_queried_tokens_total", (), "cache.num_queried_tokens"),
    ("suffixreplay_replayed_anchors_total", (), "replayed_anchors"),
    ("suffixreplay_recomputed_tokens_total", (), "recomputed_tokens"),
    ("suffixreplay_live_state_hits_total", (), "live_state_hits"),
    (
        "suffixreplay_evictions_total",
        (("tier", "host"), ("reason", "capacity")),
        "tier:host_evictions",
    ),
    (
        "suffixreplay_evictions_total",
        (("tier", "ssd"), ("reason", "budget")),
        "tier:ssd_budget_evictions",
    ),
    ("suffixreplay_prefetch_total", (("result", "hit"),), "tier:prefetch_hits"),
    ("suffixreplay_prefetch_total", (("result", "late"),), "tier:prefetch_late"),
    ("suffixreplay_prefetch_total", (("result", "miss"),), "tier:prefetch_misses"),
    ("suffixreplay_prefetch_started_total", (), "tier:prefetch_started"),
    ("suffixreplay_deferred_admissions_total", (), "tier:deferred_admissions"),
    ("suffixreplay_prefill_waits_total", (), "prefill_waits"),
    ("suffixreplay_guided_forced_tokens_total", (), "guided_forced_tokens"),
    ("suffixreplay_spec_decode_tokens_total", (("kind", "draft"),), "spec_draft_tokens"),
    ("suffixreplay_spec_decode_tokens_total", (("kind", "accepted"),), "spec_accepted_tokens"),
    ("suffixreplay_spec_corpus_drafts_total", (), "spec_corpus_drafts"),
    ("suffixreplay_beam_forks_total", (), "beam_forks"),
    ("suffixreplay_beam_copied_pages_total", (), "beam_pages_copied"),
    ("suffixreplay_ssd_bytes_total", (("direction", "read"),), "tier:ssd_bytes_read"),
    ("suffixreplay_ssd_bytes_total", (("direction", "written"),), "tier:ssd_bytes_written"),
    ("suffixreplay_checksum_failures_total", (), "tier:checksum_failures"),
    ("suffixreplay_checkpoint_state_tier_total", (("event", "spilled"),), "tier:state_spills"),
    (
        "suffixreplay_checkpoint_state_tier_total",
        (("event", "loaded_from_dram"),),
        "tier:state_loads_host",
    ),
    (
        "suffixreplay_checkpoint_state_tier_total",
        (("event", "loaded_from_ssd"),),
        "tier:state_loads_ssd",
    ),
    (
        "suffixreplay_checkpoint_state_tier_total",
        (("event", "written_to_ssd"),),
        "tier:state_ssd_writes",
    ),
    ("suffixreplay_requests_total", (), "finished_requests"),
    ("suffixreplay_unfinished_requests_total", (("reason", "cancelled"),), "cancelled_requests"),
    ("suffixreplay_unfinished_requests_total", (("reason", "failed"),), "failed_requests"),
    ("suffixreplay_unfinished_requests_total", (("reason", "timed_out"),),
     "timed_out_requests"),
    ("suffixreplay_rejected_requests_total", (("reason", "queue_full"),), "rejected_requests"),
    ("suffixreplay_preemptions_total", (), "preemptions"),
    ("suffixreplay_prefix_cache_resets_total", (), "prefix_cache_resets"),
    ("suffixreplay_retained_evictions_total", (), "cache.retained_page_evictions"),
    ("suffixreplay_shadowed_states_total", (), "cache.shadowed_states"),
)
# (family, fixed labels, label name, stats key of a {label value: count} dict)
BY_LABEL: tuple[tuple[str, tuple[tuple[str, str], ...], str, str], ...] = (
    ("suffixreplay_hit_tokens_total", (), "tier", "cache.hit_tokens_by_tier"),
    (
        "suffixreplay_evictions_total",
        (("tier", "device"),),
        "reason",
        "cache.page_evictions_by_reason",
    ),
    (
        "suffixreplay_checkpoint_evictions_total",
        (),
        "reason",
        "cache.checkpoint_evictions_by_reason",
    ),
    ("suffixreplay_ssd_chunk_rejects_total", (), "reason", "tier:chunk_rejects"),
    ("suffixreplay_memory_bytes", (), "pool", "memory_bytes"),
    ("suffixreplay_lora_requests_total", (), "adapter", "lora_requests"),
    ("suffixreplay_lora_running_requests", (), "adapter", "lora_running"),
)


class Sample(NamedTuple):
    family: str
    labels: tuple[tuple[str, str], ...]
    value: float


def samples(stats: Mapping[str, Any]) -> list[Sample]:
    """Every metric value `stats` supports (keys it lacks are skipped)."""
    flat = flatten(stats)
    tier = next((p for p in TIER_PREFIXES if any(k.startswith(p) for k in flat)), "")

    def resolve(key: str) -> str:
        return tier + key[len("tier:") :] if key.startswith("tier:") else key

    out = [
        Sample(family, labels, float(flat[resolve(key)]))
        for family, labels, key in SCALARS
        if resolve(key) in flat
    ]
    for family, fixed, label, key in BY_LABEL:
        prefix = resolve(key) + "."
        for name, count in flat.items():
            if name.startswith(prefix):
                labels = (*fixed, (label, name[len(prefix) :]))
                out.append(Sample(family, labels, float(count)))
    total, used = flat.get("kv_pages_total"), flat.get("kv_pages_used")
    if total and used is not None:
        out.append(Sample(KV_BLOCKS, (("kv_cache_block_type", "fraction"),), used / total))
    if "active_requests" in flat and "waiting_requests" in flat:
        active = flat["active_requests"] + flat["waiting_requests"]
        out.append(Sample(REQUESTS, (("request_type", "active"),), float(active)))
    hit_tokens, page_size = flat.get("cache.hit_tokens"), flat.get("page_size")
    if hit_tokens is not None and page_size:  # pages reused since start
        out.append(Sample(KV_BLOCKS, (("kv_cache_block_type", "reused"),), hit_tokens // page_size))
    return out


def flatten(stats: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts, keyed "outer.inner"."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value
    return flat


class EngineMetrics:
    """The pb_utils metric families; `update(stats)` sets the gauges that changed and advances
    the counters that grew."""

    def __init__(self, pb_utils: ModuleType, model: str, version: str) -> None:
        self.pb_utils = pb_utils
        self.common = {"model": model, "version": str(version)}
        self.families: dict[str, Any] = {}
        self.metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self.last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        if getattr(pb_utils, "MetricFamily", None) is None:
            return  # an old stub without custom metrics: serve without them
        kinds = {GAUGE: pb_utils.MetricFamily.GAUGE, COUNTER: pb_utils.MetricFamily.COUNTER}
        for name, (description, kind) in FAMILIES.items():
            self.families[name] = pb_utils.MetricFamily(
                name=name, description=description, kind=kinds[kind]
            )

    def update(self, stats: Mapping[str, Any]) -> None:
        if not self.families:
            return
        for sample in samples(stats):
            key = (sample.family, sample.labels)
            metric = self.metrics.get(key)
            if metric is None:
                family = self.families[sample.family]
                metric = family.Metric(labels={**dict(sample.labels), **self.common})
                self.metrics[key] = metric
            if FAMILIES[sample.family][1] == GAUGE:
                # Only a changed value: each set() goes through the stub to the server
                # under the GIL (a refresh of the tiered engine's 74 samples, every 100 ms:
                # 2.6 ms setting every gauge, 1.9 ms setting the changed ones; served, timed).
                if self.last.get(key) != sample.value:
                    metric.set(sample.value)
                    self.last[key] = sample.value
                continue
            increase = sample.value - self.last.get(key, 0.0)
            if increase > 0:
                metric.increment(increase)
            self.last[key] = sample.value

    def close(self) -> None:
        # The stub requires metrics to go before their families.
        self.metrics.clear()
        self.families.clear()
