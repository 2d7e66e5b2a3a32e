"""Prometheus metrics on Triton's metrics port: TensorRT-LLM's families and labels, and ours."""

from __future__ import annotations

import pytest

from backend.triton.server import ServerHandle
from client.bench.serving import stream_at_once
from client.generate import GenerateParams, generate_http
from tests.triton.llm_helpers import idle_pool, long_prompt, scrape, value, wait_until

MODEL = {"model": "hybrid_llm", "version": "1"}
KV = "nv_trt_llm_kv_cache_block_metrics"
REQUESTS = "nv_trt_llm_request_metrics"


def test_tensorrt_llm_kv_cache_block_metrics(llm_server: ServerHandle):
    idle_pool(llm_server)
    m = scrape(llm_server)

    def kv(kind: str) -> float:
        return value(m, KV, kv_cache_block_type=kind, **MODEL)

    assert kv("max") == 256
    assert kv("tokens_per") == 64
    assert kv("free") + kv("used") == kv("max")
    assert kv("fraction") == pytest.approx(kv("used") / kv("max"))
    assert kv("reused") >= 0


def test_tensorrt_llm_request_metrics(llm_server: ServerHandle):
    m = scrape(llm_server)
    assert value(m, REQUESTS, request_type="max", **MODEL) == 8
    for kind in ("active", "scheduled", "waiting"):
        assert value(m, REQUESTS, request_type=kind, **MODEL) >= 0


def test_suffixreplay_counters_follow_cache_hits(llm_server: ServerHandle):
    def hit_tokens() -> float:
        return value(scrape(llm_server), "suffixreplay_hit_tokens_total", tier="device", **MODEL)

    before = hit_tokens()
    params = GenerateParams(long_prompt("metrics prompt"), max_tokens=2, cache_salt="metrics")
    generate_http(llm_server.urls.http, params)
    second = generate_http(llm_server.urls.http, params)
    cached = second.counts["cached_tokens"]
    assert cached > 0
    wait_until(lambda: hit_tokens() >= before + cached, 10, "the hit-token counter")
    m = scrape(llm_server)
    for tier in ("device", "host", "ssd"):
        assert value(m, "suffixreplay_hit_tokens_total", tier=tier, **MODEL) >= 0
    for name in (
        "suffixreplay_queried_tokens_total",
        "suffixreplay_replayed_anchors_total",
        "suffixreplay_live_state_hits_total",
        "suffixreplay_requests_total",
    ):
        assert value(m, name, **MODEL) >= 0
    assert value(m, "suffixreplay_kv_pages", state="cached", **MODEL) > 0


def test_a_conversations_next_turn_shadows_the_state_it_resumed_from(llm_server: ServerHandle):
    """The second turn resumes from the first prompt's live state and saves its own deeper
    one: the first turn's state goes first from now on, counted in
    suffixreplay_shadowed_states_total."""
    def shadowed() -> float:
        return value(scrape(llm_server), "suffixreplay_shadowed_states_total", **MODEL)

    before = shadowed()
    first = long_prompt("shadowed turn one", 200)  # one byte token a character
    generate_http(llm_server.urls.http, GenerateParams(first, max_tokens=2, cache_salt="shadow"))
    second = generate_http(llm_server.urls.http, GenerateParams(
        first + long_prompt(" and the user's next message", 100), max_tokens=2,
        cache_salt="shadow"))
    assert second.counts["cached_tokens"] == 200 // 64 * 64
    wait_until(lambda: shadowed() >= before + 1, 10, "the shadowed-states counter")


def test_a_burst_of_one_prompt_counts_prefill_waits(llm_server: ServerHandle):
    # Three requests of one 1500-token prompt at once (3 prefill steps of 512 tokens): the
    # later ones wait for the first one's pages (share_running_prefills) and resume from them.
    def waits() -> float:
        return value(scrape(llm_server), "suffixreplay_prefill_waits_total", **MODEL)

    before = waits()
    params = GenerateParams(long_prompt("burst prompt", 1500), max_tokens=2, min_tokens=2,
                            cache_salt="prefill-waits-burst")
    results = stream_at_once(llm_server.urls.grpc, [params] * 3)
    assert sorted(r["recomputed_tokens"] for r in results)[:2] == [1500 - 1472] * 2
    wait_until(lambda: waits() > before, 10, "the prefill-wait counter")
