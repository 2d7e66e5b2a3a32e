"""`python -m client stats`'s report of the server's metrics (`client/metrics.py`), on the
metrics text hybrid_llm exports (`backend/triton/metrics.py`)."""

from __future__ import annotations

from client.metrics import cache_report, parse

TEXT = """\
suffixreplay_queried_tokens_total{model="hybrid_llm",version="1"} 100
suffixreplay_retained_evictions_total{model="hybrid_llm",version="1"} 2
suffixreplay_evictions_total{model="hybrid_llm",version="1",tier="device",reason="capacity"} 7
suffixreplay_evictions_total{model="hybrid_llm",version="1",tier="device",reason="reset"} 30
suffixreplay_evictions_total{model="hybrid_llm",version="1",tier="host",reason="capacity"} 500
suffixreplay_evictions_total{model="hybrid_llm",version="1",tier="ssd",reason="budget"} 40
"""


def test_device_evictions_count_the_device_tier_only():
    """DRAM and SSD drops and the pages a reset dropped were summed into "device
    evictions" (547 here, of 7)."""
    [line] = [x for x in cache_report(parse(TEXT)) if x.startswith("device evictions")]
    assert line.startswith("device evictions: 7 pages, 2 of them"), line
