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
        text = resp.read().decode("utf-8")
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


def page_pool(metrics: Metrics) -> dict[str, float]:
    """hybrid_llm's page pool by state (total, free, used, held_by_requests, cached)."""
    return {
        dict(labels)["state"]: v
        for (name, labels), v in metrics.items()
        if name == "suffixreplay_kv_pages"
    }
