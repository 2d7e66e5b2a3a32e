"""A real tritonserver on free loopback ports, serving a temporary copy of chosen models.

`triton_server(models, params)` (from the session fixture `triton_server`) returns a ready
`ServerHandle`; servers are shared per set of models and parameters for the whole session and
stopped at its end. `params` maps a model name to config.pbtxt parameters to set in the copy
(e.g. `{"hybrid_llm": {"cache_policy": "checkpoint"}}`). Only the named models are loaded
(explicit model control), so a model folder that is present but not finished by others does not
break these tests. When the default model's weights are missing (a checkout where training has
not run), the copy gets a randomly initialised model of the same architecture: serving behaviour
does not depend on what the weights say.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from backend.tokenizer import Tokenizer, load_tokenizer
from backend.triton.install import find_tritonserver
from backend.triton.launcher import ServerHandle, start_server
from backend.triton.repo import (  # re-exported: other test modules import them from here
    DEFAULT_MODEL,
    MODEL_REPO,
    TOKENIZER_FILES,
    copy_models,
    free_ports,
    set_parameters,
)
from backend.triton.repo import ensure_default_model as ensure_model

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_REPO",
    "TOKENIZER_FILES",
    "copy_models",
    "ensure_model",
    "free_ports",
    "set_parameters",
]

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0

Params = Mapping[str, Mapping[str, str]]
StartServer = Callable[..., ServerHandle]


def launch(models: Sequence[str], params: Params, workdir: Path) -> ServerHandle:
    repo = copy_models(models, workdir / "model_repo", TOKENIZER_FILES)
    for model, values in params.items():
        set_parameters(repo / model / "config.pbtxt", values)
    if "hybrid_llm" in models:
        ensure_model(repo)
    http, grpc, metrics = free_ports(3)
    load_args = [f"--load-model={m}" for m in models]
    server = start_server(
        repo,
        http,
        grpc,
        metrics,
        log_path=workdir / "tritonserver.log",
        extra_args=["--model-control-mode=explicit", *load_args],
    )
    try:
        server.wait_ready(READY_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        pytest.fail(f"tritonserver for {list(models)} did not start: {exc}", pytrace=False)
    return server


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    try:
        find_tritonserver()
    except FileNotFoundError as exc:
        pytest.skip(f"no tritonserver: {exc}")
    servers: dict[tuple, ServerHandle] = {}

    def start(models: Sequence[str], params: Params | None = None) -> ServerHandle:
        params = params or {}
        frozen = tuple(sorted((m, tuple(sorted(v.items()))) for m, v in params.items()))
        key = (tuple(sorted(models)), frozen)
        if key not in servers:
            servers[key] = launch(key[0], params, tmp_path_factory.mktemp("triton"))
        return servers[key]

    yield start
    for server in servers.values():
        server.stop()


# The text-generation pipeline, small enough for CI (2 cores): 256 pages of 64 tokens.
LLM_MODELS = ("ensemble", "preprocessing", "hybrid_llm", "postprocessing")
LLM_PARAMS: dict[str, dict[str, str]] = {
    "hybrid_llm": {"num_kv_pages": "256", "max_context_len": "2048", "max_num_seqs": "8"}
}


@pytest.fixture(scope="module")
def llm_server(triton_server: StartServer) -> ServerHandle:
    """The ensemble and its three models (shared by every module that asks for it)."""
    return triton_server(LLM_MODELS, LLM_PARAMS)


@pytest.fixture(scope="module")
def model_dir(llm_server: ServerHandle) -> Path:
    """The default model's folder in `llm_server`'s repository."""
    return Path(llm_server.model_repository) / DEFAULT_MODEL


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return load_tokenizer(model_dir)
