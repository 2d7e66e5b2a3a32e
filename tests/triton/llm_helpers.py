"""Helpers for tests against the served ensemble: metrics scraping, waiting, prompts."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from backend.triton.server import ServerHandle
from client.metrics import Metrics, value
from client.metrics import scrape as scrape_url

__all__ = ["Metrics", "scrape", "value"]


@contextmanager
def running_frontend(llm_server: ServerHandle, log: Path, *args: str,
                     first_url: str | None = None) -> Iterator[str]:
    """A frontend process in front of `llm_server` (its gRPC address, or `first_url`, the
    first --triton-url): its base URL (http://127.0.0.1:PORT), stopped at the end."""
    from tests.triton.conftest import free_ports

    [port] = free_ports(1)
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.openai_api", "--triton-url",
             first_url or llm_server.urls.grpc,
             "--model-repository", str(llm_server.model_repository), "--port", str(port),
             *args], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health/ready", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the frontend did not start:\n{log.read_text()}", pytrace=False)
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


def scrape(server: ServerHandle) -> Metrics:
    return scrape_url(server.urls.metrics)


def pool_state(server: ServerHandle) -> dict[str, float]:
    """What a leak would change: pages held by requests, free + cached pages, open requests."""
    m = scrape(server)
    kv = "suffixreplay_kv_pages"
    return {
        "held_by_requests": value(m, kv, state="held_by_requests"),
        "free_or_cached": value(m, kv, state="free") + value(m, kv, state="cached"),
        "active": value(m, "nv_trt_llm_request_metrics", request_type="active"),
    }


def wait_until(check: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or check}")
        time.sleep(0.05)


def idle_pool(server: ServerHandle, timeout_s: float = 30.0) -> dict[str, float]:
    """The pool state once no request is open and no page is held (metrics lag ~0.1 s)."""
    state: dict[str, float] = {}

    def idle() -> bool:
        state.update(pool_state(server))
        return state["active"] == 0 and state["held_by_requests"] == 0

    wait_until(idle, timeout_s, "an idle engine")
    return state


def long_prompt(seed: str, num_chars: int = 200) -> str:
    """ASCII text of `num_chars` characters (one byte token each) that starts with `seed`."""
    text = seed
    while len(text) < num_chars:
        text += f" {seed} {len(text)}"
    return text[:num_chars]


def assert_prompt_and_branch_served_as_generated(server: ServerHandle, engine,
                                                 seed_text: str, max_tokens: int) -> dict:
    """A prompt grown from `seed_text` (`long_prompt`), then the same with another ending, each
    streamed over gRPC (greedy) and compared with what the in-process `engine` generates;
    returns the branch's counts (cached tokens, replayed anchors, ...)."""
    from backend.engine import SamplingParams
    from client.generate import GenerateParams, stream_grpc

    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, top_k=1)
    prompt = long_prompt(seed_text, 200)
    chunks = []
    for text in (prompt, prompt[:-20] + " and another ending."):
        want = engine.tokenizer.decode(
            engine.generate(engine.tokenizer.encode(text), sampling).new_token_ids,
            skip_special_tokens=True)
        request = GenerateParams(text, max_tokens=max_tokens, min_tokens=max_tokens, top_k=1)
        chunks = list(stream_grpc(server.urls.grpc, request))
        assert "".join(c.text for c in chunks) == want
    return {k: v for c in chunks for k, v in c.counts.items()}


def serve_checkpoint(triton_server, model_dir, hybrid_params: dict | None = None):
    """The ensemble served over checkpoint `model_dir` (LLM_PARAMS plus `hybrid_params` for
    `hybrid_llm`), and the eager in-process engine of the same checkpoint: (server, engine)."""
    from backend.engine import Engine, EngineConfig
    from tests.triton.conftest import LLM_MODELS, LLM_PARAMS

    hybrid = {**LLM_PARAMS["hybrid_llm"], "model_path": str(model_dir), **(hybrid_params or {})}
    server = triton_server(LLM_MODELS, {"hybrid_llm": hybrid,
                                        "preprocessing": {"tokenizer_dir": str(model_dir)},
                                        "postprocessing": {"tokenizer_dir": str(model_dir)}})
    eager = Engine.from_model_dir(model_dir, EngineConfig.from_params(LLM_PARAMS["hybrid_llm"]))
    return server, eager


def assert_built_repository_serves_as_eager(triton_server, build, seed_text: str,
                                            max_tokens: int) -> dict:
    """`build`: (model dir, engine dir, repository) from `build.py --backend aot`. Serves the
    repository's `hybrid_llm` parameters as written (executor `compiled`) and checks a prompt
    and a branch against the eager engine of the same checkpoint; returns the branch's
    counts."""
    from backend.triton.repo import read_parameters

    model_dir, _, repo = build
    params = read_parameters(repo / "hybrid_llm" / "config.pbtxt")
    assert params["executor"] == "compiled" and params["engine_dir"] == "aot"
    server, eager = serve_checkpoint(triton_server, model_dir, params)
    return assert_prompt_and_branch_served_as_generated(server, eager, seed_text, max_tokens)


def post_json(url: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    """POSTs `body` (a dict as JSON, or raw bytes) and returns (status, JSON answer), errors
    included."""
    import json

    data = json.dumps(body).encode() if isinstance(body, dict) else body or b""
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
