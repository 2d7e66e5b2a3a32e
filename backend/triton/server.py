"""A running tritonserver process: start it, wait until ready, stop it cleanly."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, NamedTuple

from backend.triton.install import (
    PROJECT_ROOT,
    TritonInstall,
    find_tritonserver,
    prepare_backend_dir,
    server_env,
)

STOP_TIMEOUT_S = 60.0


class ServerPorts(NamedTuple):
    http: int
    grpc: int
    metrics: int


class ServerUrls(NamedTuple):
    http: str  # http://host:port
    grpc: str  # host:port, as tritonclient.grpc expects
    metrics: str  # http://host:port (Prometheus text at /metrics)


def _client_host(bind_address: str) -> str:
    # A wildcard bind is reachable on loopback; IPv6 literals need brackets in URLs.
    if bind_address in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind_address == "::":
        return "[::1]"
    return f"[{bind_address}]" if ":" in bind_address else bind_address


def _die_with_parent() -> None:
    # If the launcher is killed outright, the server must not outlive it (Linux only).
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        pr_set_pdeathsig = 1
        ctypes.CDLL(libc_name, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def orphans_of_group(leader: int) -> list[int]:
    """Processes still in the process group `leader` led, not its children: what a dead
    leader left (its pid may since belong to another process, whose own children are
    children of it and so not counted); zombies, which hold nothing, are not counted. Read
    from /proc (Linux); [] elsewhere."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        pid, ppid, pgrp = int(entry.parent.name), int(fields[1]), int(fields[2])
        if pgrp == leader and pid != leader and ppid != leader and fields[0] not in "ZX":
            found.append(pid)
    return found


class ServerHandle:
    """A started tritonserver. `wait_ready`, then use `urls`; `stop` returns its exit code."""

    def __init__(
        self,
        process: subprocess.Popen,
        install: TritonInstall,
        ports: ServerPorts,
        bind_address: str,
        workdir: Path,
        log_path: Path | None,
        model_repository: Path | None = None,
    ) -> None:
        self.process = process
        self.model_repository = model_repository
        self.install = install
        self.ports = ports
        self.workdir = workdir
        self.log_path = log_path
        host = _client_host(bind_address)
        self.urls = ServerUrls(
            http=f"http://{host}:{ports.http}",
            grpc=f"{host}:{ports.grpc}",
            metrics=f"http://{host}:{ports.metrics}",
        )

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def is_ready(self) -> bool:
        """/v2/health/ready answers 200 and the metrics page is served: tritonserver starts
        its metrics service after the HTTP one (~40 ms later here), so a client that reads
        metrics as soon as the server is ready would find the port closed."""
        for url in (f"{self.urls.http}/v2/health/ready", f"{self.urls.metrics}/metrics"):
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status != 200:
                        return False
            except (urllib.error.URLError, OSError):
                return False
        return True

    def wait_ready(self, timeout: float = 120.0, poll_s: float = 0.25) -> None:
        """Poll `is_ready`. RuntimeError if the server exits, TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise RuntimeError(
                    f"tritonserver exited with code {self.process.returncode} before it was "
                    f"ready\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(poll_s)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s\n{self.log_tail()}")

    def logs(self) -> str:
        """The server's log so far (empty when its output goes to the terminal)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, num_lines: int = 80) -> str:
        return "\n".join(self.logs().splitlines()[-num_lines:])

    def send_signal(self, signum: int) -> None:
        if self.is_alive():
            self.process.send_signal(signum)

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()

    def wait(self) -> int:
        """Wait for exit; the exit code, or 128 + signal number as a shell reports it.
        Backend stubs the server left behind (it exits without stopping them when it fails
        to start, e.g. a port taken, or is killed) are killed with it."""
        code = self.process.wait()
        self._kill_left_behind()
        self._cleanup()
        return 128 - code if code < 0 else code

    def _kill_left_behind(self) -> None:
        """SIGKILL to what is left of the server's process group (its own session: the
        server and the backend stubs it started), once the server is gone."""
        for pid in orphans_of_group(self.process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGINT (Triton drains and unloads models), then SIGKILL after `timeout` seconds."""
        self.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        except BaseException:  # interrupted (a second Ctrl-C): not left half stopped
            self.kill()
            self.wait()
            raise
        return self.wait()

    def _cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def server_command(
    install: TritonInstall,
    model_repository: Path,
    ports: ServerPorts,
    bind_address: str,
    backend_dir: Path | None,
    shm_prefix: str,
    extra_args: Sequence[str] = (),
) -> list[str]:
    cmd = [
        str(install.binary),
        f"--model-repository={model_repository}",
        f"--http-address={bind_address}",
        f"--grpc-address={bind_address}",
        f"--metrics-address={bind_address}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        # Unique shared-memory names let several servers share one host (parallel test runs).
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
    ]
    if backend_dir is not None:
        cmd.append(f"--backend-directory={backend_dir}")
    return cmd + list(extra_args)


def start_server(
    model_repository: str | Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    *,
    bind_address: str = "127.0.0.1",
    log_path: str | Path | None = None,
    extra_args: Sequence[str] = (),
    install: TritonInstall | None = None,
) -> ServerHandle:
    """Start tritonserver in the background; output goes to `log_path` or the terminal."""
    repo = Path(model_repository).resolve()
    if not repo.is_dir():
        raise FileNotFoundError(f"model repository {repo} does not exist")
    install = install or find_tritonserver()
    ports = ServerPorts(http_port, grpc_port, metrics_port)
    workdir = Path(tempfile.mkdtemp(prefix="suffixreplay-triton-"))
    backend_dir = prepare_backend_dir(install, workdir) if install.from_wheel else None
    shm_prefix = f"suffixreplay_{os.getpid()}_{http_port}_"
    cmd = server_command(install, repo, ports, bind_address, backend_dir, shm_prefix, extra_args)
    log_file = _open_log(log_path)
    try:
        # cwd = project root: the stub's Python has '' on sys.path, so `import backend` works.
        process = subprocess.Popen(
            cmd,
            cwd=PROJECT_ROOT,
            env=server_env(install),
            stdout=log_file,
            stderr=subprocess.STDOUT if log_file is not None else None,
            start_new_session=True,  # our handler forwards Ctrl-C exactly once
            preexec_fn=_die_with_parent,
        )
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        if log_file is not None:
            log_file.close()
    log = None if log_path is None else Path(log_path)
    return ServerHandle(process, install, ports, bind_address, workdir, log, repo)


def _open_log(log_path: str | Path | None) -> IO[bytes] | None:
    if log_path is None:
        return None
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    return open(log_path, "wb")  # the child keeps its own descriptor; ours is closed after Popen
