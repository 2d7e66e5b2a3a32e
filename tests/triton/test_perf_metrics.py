"""TensorRT-LLM's `return_perf_metrics` served through the ensemble: each response carries the
request's KV blocks (reused from the prefix store, allocated new, allocated in all), its
wall-clock arrival / first scheduled / first token / last token times in ns, and its
speculative drafts (verified, accepted, their rate); nothing when not asked. Checked against
what the request did (its page arithmetic, its cached_tokens, the client's own clock, the
server's Prometheus draft counters) over HTTP, gRPC streaming and the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from backend.triton.server import ServerHandle
from client.generate import PERF_METRICS, Chunk, GenerateParams, generate_http, stream_grpc
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import idle_pool, scrape, value, wait_until
from tests.triton.test_speculative import SPEC

ROOT = Path(__file__).resolve().parents[2]
PAGE = 64  # model_repo/hybrid_llm/config.pbtxt's page_size
MAX_TOKENS = 12
MODEL = {"model": "hybrid_llm", "version": "1"}
SLACK_NS = 2_000_000  # the server's clock and the client's: the same, up to rounding


def _prompt(n: int = 300) -> str:
    words = f"perf {uuid.uuid4().hex} " * (n // 38 + 1)  # unique: a cold cache
    return words[:n]


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def _timed_http(server: ServerHandle, params: GenerateParams) -> tuple[Chunk, int, int]:
    t0 = time.time_ns()
    chunk = generate_http(server.urls.http, params)
    return chunk, t0, time.time_ns()


def _check_times(perf: dict, t0: int, t1: int) -> None:
    assert t0 - SLACK_NS <= perf["arrival_time_ns"] <= perf["first_scheduled_time_ns"] \
        <= perf["first_token_time_ns"] <= perf["last_token_time_ns"] <= t1 + SLACK_NS


def test_a_miss_then_a_hit_over_http(llm_server: ServerHandle):
    params = GenerateParams(_prompt(), max_tokens=MAX_TOKENS, top_k=1, return_perf_metrics=True,
                            extra={"end_id": -1})  # no end: MAX_TOKENS tokens
    cold, t0, t1 = _timed_http(llm_server, params)
    assert set(cold.perf) == set(PERF_METRICS)
    _check_times(cold.perf, t0, t1)
    computed = cold.counts["num_input_tokens"] + MAX_TOKENS - 1  # the last token: not computed
    assert cold.perf["kv_cache_reused_blocks"] == cold.counts["cached_tokens"] == 0
    assert cold.perf["kv_cache_alloc_new_blocks"] == cold.perf["kv_cache_alloc_total_blocks"] \
        == _pages(computed)
    assert cold.perf["total_draft_tokens"] == cold.perf["acceptance_rate"] == 0

    warm, t0, t1 = _timed_http(llm_server, params)
    _check_times(warm.perf, t0, t1)
    assert warm.text == cold.text
    reused = warm.perf["kv_cache_reused_blocks"]
    assert reused == warm.counts["cached_tokens"] // PAGE > 0
    assert warm.perf["kv_cache_alloc_new_blocks"] == warm.perf["kv_cache_alloc_total_blocks"] \
        == _pages(computed) - reused
    idle_pool(llm_server)


def test_every_streamed_response_carries_the_metrics_so_far(llm_server: ServerHandle):
    params = GenerateParams(_prompt(200), max_tokens=MAX_TOKENS, top_k=1,
                            return_perf_metrics=True, extra={"end_id": -1})
    t0 = time.time_ns()
    chunks = list(stream_grpc(llm_server.urls.grpc, params))
    t1 = time.time_ns()
    perfs = [c.perf for c in chunks if c.text]
    assert len(perfs) == MAX_TOKENS
    for perf in perfs:
        _check_times(perf, t0, t1)
    assert len({p["arrival_time_ns"] for p in perfs}) == 1
    assert len({p["first_token_time_ns"] for p in perfs}) == 1
    lasts = [p["last_token_time_ns"] for p in perfs]
    assert lasts == sorted(lasts) and lasts[-1] > lasts[0]
    final = chunks[-1].perf
    assert final["kv_cache_alloc_new_blocks"] == \
        _pages(chunks[0].counts["num_input_tokens"] + MAX_TOKENS - 1)
    # Not asked: not sent.
    assert not any(c.perf for c in stream_grpc(llm_server.urls.grpc,
                                               GenerateParams(_prompt(100), max_tokens=4)))
    assert not generate_http(llm_server.urls.http, GenerateParams(_prompt(100))).perf
    idle_pool(llm_server)


def test_sequences_of_one_prompt_sum_their_blocks(llm_server: ServerHandle):
    prompt = _prompt(400)
    params = GenerateParams(prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                            num_return_sequences=3, return_perf_metrics=True,
                            extra={"end_id": -1})
    both, t0, t1 = _timed_http(llm_server, params)
    _check_times(both.perf, t0, t1)
    prompt_pages = (both.counts["num_input_tokens"] - 1) // PAGE
    # The later sequences start from the first one's cached prompt.
    assert both.perf["kv_cache_reused_blocks"] == 2 * prompt_pages
    assert both.perf["kv_cache_alloc_new_blocks"] == \
        3 * _pages(both.counts["num_input_tokens"] + MAX_TOKENS - 1) - 2 * prompt_pages
    idle_pool(llm_server)


@pytest.fixture(scope="module")
def spec_server(triton_server) -> ServerHandle:
    return triton_server(LLM_MODELS, {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], **SPEC}})


def test_speculative_drafts_are_the_servers_counters(spec_server: ServerHandle):
    def counters() -> tuple[float, float]:
        m = scrape(spec_server)
        return (value(m, "suffixreplay_spec_decode_tokens_total", kind="draft", **MODEL),
                value(m, "suffixreplay_spec_decode_tokens_total", kind="accepted", **MODEL))

    idle_pool(spec_server)
    drafts0, kept0 = counters()
    # Its own cache namespace: the server is shared with test_speculative's comparisons.
    params = GenerateParams("The cat sat on the mat. " * 6, max_tokens=48, top_k=1,
                            return_perf_metrics=True, cache_salt=uuid.uuid4().hex)
    out, t0, t1 = _timed_http(spec_server, params)
    _check_times(out.perf, t0, t1)
    perf = out.perf
    assert perf["total_draft_tokens"] > 0
    # The Prometheus counters are refreshed every stats_check_period_ms: wait for the last.
    wait_until(lambda: counters() == (drafts0 + perf["total_draft_tokens"],
                                      kept0 + perf["total_accepted_draft_tokens"]),
               what="the draft counters to reach the request's")
    assert perf["acceptance_rate"] == pytest.approx(perf["total_accepted_draft_tokens"]
                                                    / perf["total_draft_tokens"])
    idle_pool(spec_server)


def test_the_cli_reports_the_servers_metrics(llm_server: ServerHandle):
    result = subprocess.run(
        [sys.executable, "-m", "client", "generate", _prompt(200), "--url",
         llm_server.urls.grpc, "--max-tokens", "8", "--top-k", "1", "--perf-metrics"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    found = re.search(r"\[server: queue \d+\.\d ms, ttft \d+\.\d ms, last token \d+\.\d ms; "
                      r"kv blocks reused 0, allocated (\d+) new / (\d+) total\]", result.stderr)
    assert found, result.stderr
    assert int(found[1]) == int(found[2]) >= _pages(200)
