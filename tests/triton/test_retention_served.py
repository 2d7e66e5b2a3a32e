"""TensorRT-LLM's KV cache retention inputs served through the ensemble
(`retention_token_range_*`, `retention_decode_*`): on a server whose prefix cache keeps at
most 8 idle pages, a system prompt sent with priority 100 is still cached after a flood of
other prompts that pushes it out without one; the same through gRPC streaming and the CLI's
`--retain`; bad values are INVALID_ARG naming what was wrong; retained pages that outgrow
the cache show in suffixreplay_retained_evictions_total."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from backend.triton.server import ServerHandle
from client.generate import GenerateError, GenerateParams, generate_http, stream_grpc
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import idle_pool, scrape, value, wait_until

ROOT = Path(__file__).resolve().parents[2]
PAGE = 64
SYSTEM_PAGES = 4
# 8 idle pages at most: three 300-token prompts leave 12.
PARAMS = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "max_cached_pages": "8"}}
KEEP = ((0, -1, 100, -1),)
MODEL = {"model": "hybrid_llm", "version": "1"}  # the whole prompt at priority 100, for ever


@pytest.fixture(scope="module")
def server(triton_server) -> ServerHandle:
    return triton_server(LLM_MODELS, PARAMS)


def _text(n: int) -> str:
    words = f"{uuid.uuid4().hex} " * (n // 33 + 1)  # unique: a cold cache; 1 byte a token
    return words[:n]


def _send(server: ServerHandle, prompt: str, grpc: bool = False, **retention) -> dict:
    params = GenerateParams(prompt, max_tokens=8, top_k=1, **retention)
    if grpc:
        chunks = list(stream_grpc(server.urls.grpc, params, stream=True))
        return chunks[-1].counts
    return generate_http(server.urls.http, params).counts


def _system_after_flood(server: ServerHandle, grpc: bool = False, **retention) -> int:
    """cached_tokens of [system prompt : question] after the system prompt was sent (with
    `retention`) and three other prompts followed."""
    system = _text(SYSTEM_PAGES * PAGE + 44)
    _send(server, system, grpc, **retention)
    for _ in range(3):
        _send(server, _text(300))
    idle_pool(server)
    return _send(server, system + " question?")["cached_tokens"]


def test_a_retained_system_prompt_survives_a_flood(server):
    assert _system_after_flood(server) == 0  # the plain LRU evicted it
    assert _system_after_flood(server, retention_ranges=KEEP) == SYSTEM_PAGES * PAGE


def test_over_grpc_streaming_with_an_expiring_range_and_decode_priority(server):
    retention = dict(retention_ranges=((0, SYSTEM_PAGES * PAGE, 90, 600_000),),
                     retention_decode_priority=0, retention_decode_duration_ms=1000)
    assert _system_after_flood(server, grpc=True, **retention) == SYSTEM_PAGES * PAGE


def test_the_cli_retains_a_prompt(server):
    system = _text(SYSTEM_PAGES * PAGE + 44)
    cmd = [sys.executable, "-m", "client", "generate", "--url", server.urls.grpc,
           "--max-tokens", "4", "--retain", "100", system]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for _ in range(3):
        _send(server, _text(300))
    assert _send(server, system + " question?")["cached_tokens"] == SYSTEM_PAGES * PAGE
    bad = subprocess.run(cmd[:-2] + ["101", system], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "priority must be in [0, 100]" in bad.stderr


@pytest.mark.parametrize("fields, message", [
    ({"retention_token_range_starts": [0], "retention_token_range_ends": [-1],
      "retention_token_range_priorities": [101]}, "priority must be an integer in [0, 100]"),
    ({"retention_token_range_starts": [0, 64], "retention_token_range_ends": [-1],
      "retention_token_range_priorities": [50, 50]},
     "retention_token_range_ends has 1 values, retention_token_range_starts 2"),
    ({"retention_token_range_starts": [0]}, "needs retention_token_range_ends"),
    ({"retention_token_range_priorities": [50]},
     "retention_token_range_priorities needs retention_token_range_starts"),
    ({"retention_token_range_ends": [-1]},
     "retention_token_range_ends needs retention_token_range_starts"),
    ({"retention_token_range_starts": [64], "retention_token_range_ends": [10],
      "retention_token_range_priorities": [50]}, "end must be an integer > its start"),
    ({"retention_decode_priority": 50, "retention_decode_duration_ms": -5},
     "retention duration must be >= 0 ms"),
])
def test_bad_retention_is_invalid_arg(server, fields, message):
    params = GenerateParams(_text(80), max_tokens=4, extra=fields)
    with pytest.raises(GenerateError) as info:
        generate_http(server.urls.http, params)
    assert info.value.status == "HTTP 400" and message in info.value.message
    with pytest.raises(GenerateError) as info:
        list(stream_grpc(server.urls.grpc, params, stream=True))
    assert message in info.value.message
    idle_pool(server)


def test_retained_pages_that_outgrow_the_cache_are_counted(server):
    """More pages at priority 100 than the 8 the cache keeps: some of them go, and
    suffixreplay_retained_evictions_total says so (a retention floor too big for the pool)."""
    def evicted() -> float:
        return value(scrape(server), "suffixreplay_retained_evictions_total", **MODEL)

    before = evicted()
    for _ in range(3):  # 12 pages at 100
        _send(server, _text(300), retention_ranges=KEEP)
    wait_until(lambda: evicted() >= before + 4, what="retained evictions in the metrics")
