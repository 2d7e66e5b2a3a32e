"""Start the real `tritonserver` on this project's model repository.

    python -m backend.triton.launcher [--model-repository model_repo] [-- extra tritonserver args]

Binds 127.0.0.1 unless BIND_ADDRESS says otherwise; HTTP_PORT (8000), GRPC_PORT (8001),
METRICS_PORT (8002) and MODEL_REPO override the defaults. Ctrl-C (or SIGTERM) is forwarded to the
server, which drains and exits; a second one kills it.

Library use (tests, benchmarks):

    with start_server("model_repo", http_port, grpc_port, metrics_port, log_path=...) as server:
        server.wait_ready(timeout=120)
        ... server.urls.http ...
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from backend.triton.install import find_tritonserver
from backend.triton.server import ServerHandle, ServerPorts, start_server

__all__ = ["ServerHandle", "ServerPorts", "main", "start_server"]

DEFAULT_PORTS = ServerPorts(http=8000, grpc=8001, metrics=8002)
READY_TIMEOUT_S = 600.0  # a large model may take minutes to load


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer port, got {value!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m backend.triton.launcher", description="Start tritonserver."
    )
    parser.add_argument("--model-repository", default=os.environ.get("MODEL_REPO", "model_repo"))
    parser.add_argument("--http-port", type=int, default=_env_int("HTTP_PORT", DEFAULT_PORTS.http))
    parser.add_argument("--grpc-port", type=int, default=_env_int("GRPC_PORT", DEFAULT_PORTS.grpc))
    parser.add_argument(
        "--metrics-port", type=int, default=_env_int("METRICS_PORT", DEFAULT_PORTS.metrics)
    )
    parser.add_argument("--bind-address", default=os.environ.get("BIND_ADDRESS", "127.0.0.1"))
    parser.add_argument("extra", nargs="*", help="passed to tritonserver (after --)")
    return parser.parse_args(argv)


def banner(server: ServerHandle) -> str:
    urls = server.urls
    curl = (
        f"curl -s -X POST {urls.http}/v2/models/ensemble/generate "
        """-d '{"text_input": "What is machine learning?", "max_tokens": 32}'"""
    )
    return "\n".join(
        [
            f"tritonserver ready ({server.install.binary})",
            f"  HTTP    {urls.http}",
            f"  gRPC    {urls.grpc}",
            f"  metrics {urls.metrics}/metrics",
            "try:",
            f"  {curl}",
        ]
    )


def _forward_signals(server: ServerHandle) -> list[int]:
    """Forward SIGINT/SIGTERM to the server once, kill on the second; returns the signals seen."""
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            print(f"\nstopping tritonserver (signal {signum}); again to kill", file=sys.stderr)
            server.send_signal(signum)
        else:
            server.kill()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return received


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repo = Path(args.model_repository)
    if not repo.is_dir():
        print(f"model repository {repo.resolve()} does not exist", file=sys.stderr)
        return 2
    server = start_server(
        repo,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        bind_address=args.bind_address,
        install=find_tritonserver(),
        extra_args=args.extra,
    )
    received = _forward_signals(server)
    try:
        server.wait_ready(READY_TIMEOUT_S)
        print(banner(server), flush=True)
    except (RuntimeError, TimeoutError) as exc:
        code = server.stop()
        if received:  # stopped on purpose while loading: nothing to report
            return code
        print(f"tritonserver did not become ready: {exc}", file=sys.stderr)
        return code or 1
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
