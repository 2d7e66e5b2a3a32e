"""A served copy of the model repository and the same engine in-process, for benchmarks.

`served_repository` starts tritonserver on free loopback ports over a temporary copy of
`model_repo/` (parameters overridable); `in_process_engine` builds the `Engine` that copy's
hybrid_llm would build, from the same config.pbtxt parameters.

A benchmark that starts many servers one after another may let each one shut down in the
background (`stop_in_background`): Triton's shutdown is mostly waiting (it polls for unloaded
models once a second), so the next server starts meanwhile, and is used only once every
server stopping in the background has exited.
"""

from __future__ import annotations

import atexit
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from backend.engine import Engine, EngineConfig
from backend.triton.llm_config import DEFAULT_MODEL_PATH, SERVING_KEYS
from backend.triton.repo import (
    TOKENIZER_FILES,
    copy_models,
    ensure_default_model,
    free_ports,
    read_parameters,
    set_parameters,
)
from backend.triton.server import ServerHandle, start_server
from client.generate import GenerateParams, stream_grpc

MODELS = ("ensemble", "preprocessing", "hybrid_llm", "postprocessing")
READY_TIMEOUT_S = 300.0


_stopping: list[threading.Thread] = []  # servers shutting down in the background
_started: set[ServerHandle] = set()  # servers not yet stopped


def wait_for_stopped_servers() -> None:
    """Returns once every server stopping in the background has exited."""
    while _stopping:
        _stopping.pop().join()


@atexit.register
def kill_unstopped_servers() -> None:
    """Kills (with their backend stubs) the servers a run leaves behind when it is
    interrupted: one whose background stop was cut short, or one the interrupt reached
    mid-start. Their death signal alone would not do: it fires when the thread that started
    the server ends, and a server already shutting down may ignore it."""
    for server in list(_started):
        server.kill()
        server.wait()
        _started.discard(server)


@contextmanager
def served_repository(params: Mapping[str, str] | None = None,
                      stop_in_background: bool = False,
                      models: Sequence[str] = MODELS) -> Iterator[ServerHandle]:
    """A ready server for a copy of model_repo/'s `models` with hybrid_llm `params` set.

    stop_in_background: on exit the server is signalled and left to finish its shutdown in a
    thread; the next `served_repository` waits for it once its own server is ready (so
    measurements never overlap a shutdown), as does `wait_for_stopped_servers`."""
    tmp = tempfile.mkdtemp(prefix="bench-")
    server = None

    def stop() -> None:
        try:
            if server is not None:
                server.stop()
                _started.discard(server)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    try:
        repo = copy_models(models, Path(tmp) / "model_repo", TOKENIZER_FILES)
        set_parameters(repo / "hybrid_llm" / "config.pbtxt", dict(params or {}))
        if ensure_default_model(repo):
            print("warning: no trained default model; serving random weights", file=sys.stderr)
        http, grpc, metrics = free_ports(3)
        loads = [f"--load-model={m}" for m in models]
        server = start_server(
            repo,
            http,
            grpc,
            metrics,
            log_path=Path(tmp) / "tritonserver.log",
            extra_args=["--model-control-mode=explicit", *loads],
        )
        _started.add(server)
        server.wait_ready(READY_TIMEOUT_S)
        wait_for_stopped_servers()
        yield server
    except BaseException:
        stop()
        raise
    if stop_in_background:
        thread = threading.Thread(target=stop, name="server-stop", daemon=True)
        thread.start()
        _stopping.append(thread)
    else:
        stop()


def in_process_engine(server: ServerHandle) -> Engine:
    """The engine the server's hybrid_llm runs: same model folder, same parameters."""
    assert server.model_repository is not None
    model_dir = Path(server.model_repository) / "hybrid_llm"
    params = read_parameters(model_dir / "config.pbtxt")
    model_path = model_dir / (params.get("model_path") or DEFAULT_MODEL_PATH)
    engine_params = {k: v for k, v in params.items() if k not in SERVING_KEYS and v}
    return Engine.from_model_dir(model_path, EngineConfig.from_params(engine_params))


def stream_at_once(url: str, requests: Sequence[GenerateParams],
                   model: str = "ensemble") -> list[dict[str, float]]:
    """Streams every request at once over gRPC (one thread each) to `model`. Per request, in
    order: seconds to its first token and to its end (since it was sent), the prompt tokens
    the engine prefilled for it (`recomputed_tokens`) and its output tokens."""
    results = [{"first_token_s": 0.0, "done_s": 0.0, "recomputed_tokens": 0, "tokens": 0}
               for _ in requests]
    errors: list[BaseException] = []

    def client(params: GenerateParams, out: dict[str, float]) -> None:
        try:
            for c in stream_grpc(url, params, model=model):
                if c.counts.get("num_output_tokens") and not out["first_token_s"]:
                    out["first_token_s"] = c.elapsed_s
                out["tokens"] += c.counts.get("num_output_tokens", 0)  # each response's own
                out["recomputed_tokens"] = c.counts.get("recomputed_tokens",
                                                        out["recomputed_tokens"])
                out["done_s"] = c.elapsed_s
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(p, out))
               for p, out in zip(requests, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def describe(values: Sequence[float]) -> dict[str, float]:
    """Mean, P50, P95, P99 in milliseconds of values in seconds."""
    if not values:
        return {}
    ms = [v * 1000 for v in values]
    return {
        "mean_ms": round(statistics.fmean(ms), 3),
        "p50_ms": round(percentile(ms, 50), 3),
        "p95_ms": round(percentile(ms, 95), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "count": len(ms),
    }
