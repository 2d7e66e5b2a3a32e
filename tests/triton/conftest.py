"""A real tritonserver on free loopback ports, serving a temporary copy of chosen models.

`triton_server(models)` (from the session fixture `triton_server`) returns a ready
`ServerHandle`; servers are shared per set of models for the whole session and stopped at its
end. Only the named models are loaded (explicit model control), so a model folder that is
present but not finished by others does not break these tests.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import pytest

from backend.triton.install import find_tritonserver
from backend.triton.launcher import ServerHandle, start_server

ROOT = Path(__file__).resolve().parents[2]
MODEL_REPO = ROOT / "model_repo"
# Files other models point at: the default tokenizer that lives beside the default model.
TOKENIZER_FILES = (
    "hybrid_llm/1/tiny_qwen3_5/tokenizer.json",
    "hybrid_llm/1/tiny_qwen3_5/tokenizer_config.json",
)
READY_TIMEOUT_S = 120.0

StartServer = Callable[[Sequence[str]], ServerHandle]


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free on loopback (held open together so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def copy_models(models: Sequence[str], dest: Path, extra_files: Sequence[str]) -> Path:
    for model in models:
        shutil.copytree(
            MODEL_REPO / model, dest / model, ignore=shutil.ignore_patterns("__pycache__")
        )
    for rel in extra_files:
        target = dest / rel
        if not target.exists() and (MODEL_REPO / rel).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(MODEL_REPO / rel, target)
    return dest


def launch(models: Sequence[str], workdir: Path) -> ServerHandle:
    repo = copy_models(models, workdir / "model_repo", TOKENIZER_FILES)
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
    servers: dict[tuple[str, ...], ServerHandle] = {}

    def start(models: Sequence[str]) -> ServerHandle:
        key = tuple(sorted(models))
        if key not in servers:
            servers[key] = launch(key, tmp_path_factory.mktemp("triton"))
        return servers[key]

    yield start
    for server in servers.values():
        server.stop()
