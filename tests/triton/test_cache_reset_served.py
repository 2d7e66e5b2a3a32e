"""Resetting the prefix cache of a served model: hybrid_llm's `reset_prefix_cache` input
(through `client.generate.reset_prefix_cache` and `python -m client reset-cache`), one
cache_salt namespace or all of them; a request streaming through the reset keeps its text;
the counters show it; the OpenAI frontend's `POST /reset_prefix_cache` (off unless
`--enable-cache-reset`)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from backend.triton.server import ServerHandle
from client.generate import (
    GenerateError,
    GenerateParams,
    generate_http,
    reset_prefix_cache,
    stream_grpc,
)
from client.metrics import by_label
from tests.triton.llm_helpers import post_json, running_frontend, scrape, value

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"model": "hybrid_llm", "version": "1"}


def _prompt(n: int = 300) -> str:
    return (f"{uuid.uuid4().hex} " * (n // 33 + 1))[:n]  # unique: a cold cache


def _cached(server: ServerHandle, prompt: str, salt: str) -> int:
    params = GenerateParams(prompt, max_tokens=4, top_k=1, cache_salt=salt)
    return generate_http(server.urls.http, params).counts["cached_tokens"]


def test_a_namespace_reset_forgets_its_prefixes_only(llm_server):
    a, b = _prompt(), _prompt()
    for prompt, salt in ((a, "reset-a"), (b, "reset-b")):
        _cached(llm_server, prompt, salt)
        assert _cached(llm_server, prompt, salt) > 0
    before = scrape(llm_server)
    counts = reset_prefix_cache(llm_server.urls.grpc, cache_salt="reset-a")
    assert counts["dropped_pages"] >= 300 // 64 and counts["kept_pages"] == 0
    assert _cached(llm_server, a, "reset-a") == 0
    assert _cached(llm_server, b, "reset-b") > 0
    after = scrape(llm_server)
    name = "suffixreplay_prefix_cache_resets_total"
    assert value(after, name, **MODEL) == value(before, name, **MODEL) + 1
    evicted = by_label(after, "suffixreplay_evictions_total", "reason")["reset"]
    assert evicted >= by_label(before, "suffixreplay_evictions_total", "reason").get(
        "reset", 0) + counts["dropped_pages"]


def test_the_cli_resets_every_namespace(llm_server):
    prompt = _prompt()
    _cached(llm_server, prompt, "reset-cli")
    assert _cached(llm_server, prompt, "reset-cli") > 0
    result = subprocess.run([sys.executable, "-m", "client", "reset-cache", "--url",
                             llm_server.urls.grpc], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "every namespace" in result.stdout and "pages dropped" in result.stdout
    assert _cached(llm_server, prompt, "reset-cli") == 0


def test_a_streaming_request_goes_on_through_a_reset(llm_server):
    """The running request's pages are held: kept, not dropped; its text is what it is
    without the reset."""
    prompt = _prompt(400)
    # Long enough that the reset after its second chunk finds it running even when the
    # client reads the stream late (48 tokens had ended before a loaded CI host's reset).
    params = GenerateParams(prompt, max_tokens=1200, min_tokens=1200, top_k=1,
                            cache_salt="reset-stream")
    want = generate_http(llm_server.urls.http, params).text
    reset_prefix_cache(llm_server.urls.grpc, cache_salt="reset-stream")
    chunks, counts = [], None
    for chunk in stream_grpc(llm_server.urls.grpc, params):
        chunks.append(chunk.text)
        if len(chunks) == 2:  # prefilled and decoding
            counts = reset_prefix_cache(llm_server.urls.grpc, cache_salt="reset-stream")
    assert "".join(chunks) == want
    assert counts is not None and counts["kept_pages"] >= 400 // 64


def test_a_namespace_never_used_has_nothing_to_drop(llm_server):
    assert reset_prefix_cache(llm_server.urls.grpc, cache_salt=uuid.uuid4().hex) == \
        {"dropped_pages": 0, "kept_pages": 0}


def test_a_salt_naming_an_adapters_namespace_is_refused(llm_server):
    """"<salt>\\x00lora:<name>" is adapter <name>'s namespace: no client salt may spell it."""
    with pytest.raises(GenerateError, match="cache_salt must not contain NUL"):
        reset_prefix_cache(llm_server.urls.grpc, cache_salt="\x00lora:math")


def test_the_frontend_route_is_off_unless_enabled(llm_server, tmp_path):
    with running_frontend(llm_server, tmp_path / "off.log") as url:
        status, body = post_json(f"{url}/reset_prefix_cache")
    assert status == 404 and "error" in body


def test_the_frontend_resets_the_replicas(llm_server, tmp_path):
    prompt = _prompt()
    _cached(llm_server, prompt, "reset-http")
    assert _cached(llm_server, prompt, "reset-http") > 0
    with running_frontend(llm_server, tmp_path / "on.log", "--enable-cache-reset") as url:
        status, body = post_json(f"{url}/reset_prefix_cache?cache_salt=reset-http")
        assert status == 200, body
        assert body["cache_salt"] == "reset-http" and body["dropped_pages"] >= 300 // 64
        assert [r["url"] for r in body["replicas"]] == [llm_server.urls.grpc]
        assert _cached(llm_server, prompt, "reset-http") == 0
        status, body = post_json(f"{url}/reset_prefix_cache", b'{"cache_salt": 7}')
        assert status == 400 and "cache_salt" in body["error"]["message"]
        status, body = post_json(f"{url}/reset_prefix_cache", b'{"cache_salt": "reset-http"}')
        assert status == 200 and body["dropped_pages"] > 0  # the _cached above, cached again
