"""Speculative decoding served (`speculative_method: ngram` / `suffix` in hybrid_llm's
parameters): the ensemble's outputs are the server's without it (greedy, seeded sampling,
streamed or not, several sequences of one prompt), a streamed response may carry several
tokens, the draft counters reach Prometheus and `python -m client stats`, and suffix decoding
drafts a repeated answer from the earlier one within a cache namespace only."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from backend.triton.server import ServerHandle
from client.generate import GenerateParams, generate_http, stream_grpc
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import idle_pool, scrape, value

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"model": "hybrid_llm", "version": "1"}
PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
           "def mul(a, b):\n"]
# Every proposal verified whole (the adaptive cut depends on measured step times).
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": "4", "prompt_lookup_min": "2",
        "speculative_adaptive": "false"}


@pytest.fixture(scope="module")
def spec_server(triton_server) -> ServerHandle:
    return triton_server(LLM_MODELS, {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], **SPEC}})


def _drafts(server: ServerHandle) -> tuple[float, float]:
    m = scrape(server)
    return (value(m, "suffixreplay_spec_decode_tokens_total", kind="draft", **MODEL),
            value(m, "suffixreplay_spec_decode_tokens_total", kind="accepted", **MODEL))


@pytest.mark.parametrize("options", [dict(top_k=1), dict(temperature=0.9, top_p=0.95, seed=7),
                                     dict(top_k=1, num_return_sequences=2)])
def test_outputs_are_the_plain_servers(llm_server: ServerHandle, spec_server: ServerHandle,
                                       options):
    drafts0, kept0 = _drafts(spec_server)
    for prompt in PROMPTS:
        # cold on both servers: a prompt other tests cached could be served from replayed
        # states, whose last bits can tip a sampled token
        params = GenerateParams(prompt, max_tokens=64, cache_salt=uuid.uuid4().hex, **options)
        want = generate_http(llm_server.urls.http, params).texts
        assert generate_http(spec_server.urls.http, params).texts == want
        chunks = list(stream_grpc(spec_server.urls.grpc, params))
        for k, text in enumerate(want):
            mine = [c for c in chunks if c.sequence_index == k]
            assert "".join(c.text for c in mine) == text
            assert sum(c.counts.get("num_output_tokens", 0) for c in mine) == \
                len(text.encode())
    drafts, kept = _drafts(spec_server)
    assert 0 < kept - kept0 <= drafts - drafts0
    idle_pool(spec_server)


def test_client_stats_report_the_drafts(spec_server: ServerHandle):
    generate_http(spec_server.urls.http, GenerateParams(PROMPTS[0], max_tokens=32, top_k=1))
    time.sleep(0.5)  # the metrics thread refreshes every 100 ms
    drafts, kept = _drafts(spec_server)
    result = subprocess.run([sys.executable, "-m", "client", "stats", "--metrics-url",
                             spec_server.urls.metrics], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"speculative drafts: {drafts:.0f} tokens verified, {kept:.0f} kept" in \
        result.stdout, result.stdout


def test_a_streamed_response_carries_the_tokens_kept(spec_server: ServerHandle):
    """Greedy tokens of a repetitive prompt: drafts kept, so fewer responses than tokens."""
    params = GenerateParams(PROMPTS[1], max_tokens=64, top_k=1)
    chunks = [c for c in stream_grpc(spec_server.urls.grpc, params) if c.text]
    assert len(chunks) < 40
    assert max(c.counts.get("num_output_tokens", 0) for c in chunks) > 1


def test_suffix_decoding_drafts_a_repeated_answer_from_the_earlier_one(
        llm_server: ServerHandle, triton_server):
    """`speculative_method: suffix`: a question asked again in the same cache namespace is
    drafted from the first answer (suffixreplay_spec_corpus_drafts_total grows), asked under
    another cache_salt it is not; the texts are the plain server's."""
    server = triton_server(LLM_MODELS, {"hybrid_llm": {
        **LLM_PARAMS["hybrid_llm"], **SPEC, "speculative_method": "suffix"}})
    prompt = "Q: What is the capital of Spain?\nA:"

    def corpus_drafts() -> float:
        time.sleep(0.5)  # the metrics thread refreshes every 100 ms
        return value(scrape(server), "suffixreplay_spec_corpus_drafts_total", **MODEL)

    want = generate_http(llm_server.urls.http, GenerateParams(prompt, max_tokens=48,
                                                              top_k=1)).texts
    for salt, grows in (("tenant-a", False), ("tenant-a", True), ("tenant-b", False)):
        before = corpus_drafts()
        params = GenerateParams(prompt, max_tokens=48, top_k=1, cache_salt=salt)
        assert generate_http(server.urls.http, params).texts == want
        assert (corpus_drafts() > before) == grows, salt
    idle_pool(server)
