"""Reading Triton's Prometheus endpoint: every sample keyed by (name, labels)."""

from __future__ import annotations

import re
import urllib.request

SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics_url: str) -> Metrics:
    """`metrics_url` is http://host:port (the server's --metrics-port)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as resp:
        return parse(resp.read().decode("utf-8"))


def parse(text: str) -> Metrics:
    """Prometheus' text format -> every sample keyed by (name, labels)."""
    samples: Metrics = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            name, labels, value = match.groups()
            samples[(name, frozenset(LABEL.findall(labels or "")))] = float(value)
    return samples


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= ls]
    if len(found) != 1:
        raise KeyError(f"{len(found)} samples of {name}{labels}")
    return found[0]


def by_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    """{label value: value} of one family, summed over its other labels (model, version)."""
    out: dict[str, float] = {}
    for (n, labels), v in metrics.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def total(metrics: Metrics, name: str, **labels: str) -> float | None:
    """The sum of the samples of `name` whose labels include `labels`; None if none."""
    values = [v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= ls]
    return sum(values) if values else None


def page_pool(metrics: Metrics) -> dict[str, float]:
    """hybrid_llm's page pool by state (total, free, used, held_by_requests, cached)."""
    return by_label(metrics, "suffixreplay_kv_pages", "state")


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cache_report(metrics: Metrics) -> list[str]:
    """What `python -m client stats` prints: the prefix cache's hits by tier, pages, bytes in
    use, prefetches, evictions, speculative drafts and requests, from hybrid_llm's `suffixreplay_*`
    families. Lines whose
    families the server does not export (no tiers, no prefetcher) are left out."""
    lines = []
    queried = total(metrics, "suffixreplay_queried_tokens_total")
    if queried is None:
        return ["no suffixreplay_* metrics: is hybrid_llm loaded on this server?"]
    hits = by_label(metrics, "suffixreplay_hit_tokens_total", "tier")
    hit = sum(hits.values())
    share = f" ({hit / queried:.1%})" if queried else ""
    tiers = ", ".join(f"{name} {hits.get(key, 0):.0f}" for key, name in
                      (("device", "device"), ("host", "DRAM"), ("ssd", "SSD")) if key in hits)
    lines.append(f"prompt tokens: {queried:.0f} looked up, {hit:.0f} from the cache{share}"
                 + (f": {tiers}" if tiers else ""))
    rest = [(name, total(metrics, family)) for name, family in (
        ("recomputed", "suffixreplay_recomputed_tokens_total"),
        ("anchors replayed", "suffixreplay_replayed_anchors_total"),
        ("live-state hits", "suffixreplay_live_state_hits_total"))]
    lines.append("  " + ", ".join(f"{name} {v:.0f}" for name, v in rest if v is not None))
    pool = page_pool(metrics)
    if pool:
        lines.append("pages: " + ", ".join(f"{pool[k]:.0f} {k.replace('_', ' ')}" for k in (
            "total", "used", "cached", "held_by_requests") if k in pool))
    memory = by_label(metrics, "suffixreplay_memory_bytes", "pool")
    if memory:
        names = (("device_kv", "device KV"), ("device_anchors", "anchors"),
                 ("device_states", "states"), ("host", "DRAM"), ("ssd", "SSD"))
        lines.append("memory in use: " + ", ".join(f"{name} {_mib(memory[key])}"
                                                   for key, name in names if key in memory))
    started = total(metrics, "suffixreplay_prefetch_started_total")
    if started is not None:
        result = by_label(metrics, "suffixreplay_prefetch_total", "result")
        lines.append(f"SSD prefetch: {started:.0f} reads started; pages needed: "
                     + ", ".join(f"{k} {result.get(k, 0):.0f}" for k in ("hit", "late", "miss")))
    ssd = by_label(metrics, "suffixreplay_ssd_bytes_total", "direction")
    if ssd:
        lines.append(f"SSD: {_mib(ssd.get('read', 0))} read, {_mib(ssd.get('written', 0))} "
                     "written")
    retained = total(metrics, "suffixreplay_retained_evictions_total")
    if retained is not None:
        # the device tier's evictions for room (DRAM / SSD drops and reset pages are not)
        evicted = sum(v for (n, labels), v in metrics.items()
                      if n == "suffixreplay_evictions_total" and ("tier", "device") in labels
                      and dict(labels).get("reason") != "reset")
        lines.append(f"device evictions: {evicted:.0f} pages, {retained:.0f} of them above the "
                     "default retention priority")
    spec = by_label(metrics, "suffixreplay_spec_decode_tokens_total", "kind")
    if spec.get("draft"):
        kept = spec.get("accepted", 0)
        lines.append(f"speculative drafts: {spec['draft']:.0f} tokens verified, {kept:.0f} kept "
                     f"({kept / spec['draft']:.1%})")
    done = total(metrics, "suffixreplay_requests_total")
    if done is not None:
        ended = by_label(metrics, "suffixreplay_unfinished_requests_total", "reason")
        preempted = total(metrics, "suffixreplay_preemptions_total") or 0
        lines.append(f"requests: {done:.0f} finished, {ended.get('cancelled', 0):.0f} "
                     f"cancelled, {ended.get('timed_out', 0):.0f} timed out, "
                     f"{ended.get('failed', 0):.0f} failed; {preempted:.0f} preemptions")
    return lines
