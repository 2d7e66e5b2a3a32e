from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.triton import install
from backend.triton.install import find_tritonserver, prepare_backend_dir, server_env
from backend.triton.launcher import parse_args, start_server
from tests.triton.conftest import TOKENIZER_FILES, copy_models, free_ports

ROOT = Path(__file__).resolve().parents[2]


def wheel_install() -> install.TritonInstall:
    try:
        found = find_tritonserver()
    except FileNotFoundError as exc:
        pytest.skip(f"no tritonserver: {exc}")
    if not found.from_wheel:
        pytest.skip(f"{found.binary} is a system install, not the nvidia-pytriton wheel")
    return found


def test_explicit_binary_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONSERVER", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="TRITONSERVER=.*nope"):
        find_tritonserver()


def test_backend_dir_holds_the_stub_for_this_python(tmp_path):
    found = wheel_install()
    backend_dir = prepare_backend_dir(found, tmp_path)
    stub = backend_dir / "python" / install.STUB_NAME
    assert stub.resolve() == found.stub_path(install.python_version()).resolve()
    assert (backend_dir / "python" / "libtriton_python.so").exists()


def test_missing_stub_version_lists_available():
    found = wheel_install()
    with pytest.raises(FileNotFoundError, match=r"Python 2\.7 .*available: \['3\."):
        found.stub_path("2.7")


def test_env_puts_this_interpreter_first():
    env = server_env(wheel_install(), base={"PATH": "/usr/bin"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(install.PROJECT_ROOT)
    libpython = install.libpython_dir()
    if libpython is not None:
        assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(libpython)


def test_ports_and_address_come_from_env(monkeypatch):
    monkeypatch.setenv("HTTP_PORT", "9100")
    monkeypatch.setenv("BIND_ADDRESS", "0.0.0.0")
    monkeypatch.setenv("MODEL_REPO", "elsewhere")
    args = parse_args([])
    assert (args.http_port, args.grpc_port, args.bind_address) == (9100, 8001, "0.0.0.0")
    assert args.model_repository == "elsewhere"
    monkeypatch.setenv("GRPC_PORT", "x")
    with pytest.raises(ValueError, match="GRPC_PORT must be an integer port, got 'x'"):
        parse_args([])


def read_lines(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)


@pytest.mark.slow
def test_cli_prints_urls_and_stops_on_sigint(tmp_path):
    wheel_install()
    repo = copy_models(["preprocessing"], tmp_path / "repo", TOKENIZER_FILES)
    http, grpc, metrics = free_ports(3)
    env = {
        **os.environ,
        "HTTP_PORT": str(http),
        "GRPC_PORT": str(grpc),
        "METRICS_PORT": str(metrics),
        "MODEL_REPO": str(repo),
    }
    cmd = [
        sys.executable,
        "-m",
        "backend.triton.launcher",
        "--",
        "--model-control-mode=explicit",
        "--load-model=preprocessing",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        text=True,
        errors="replace",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True).start()
    output = []
    deadline = time.monotonic() + 120
    try:
        while not any("/v2/models/ensemble/generate" in line for line in output):
            assert time.monotonic() < deadline, "".join(output)
            output.append(lines.get(timeout=120))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    text = "".join(output)
    assert f"HTTP    http://127.0.0.1:{http}" in text
    assert f"gRPC    127.0.0.1:{grpc}" in text
    assert '"max_tokens": 32' in text


@pytest.mark.slow
def test_bad_parameter_fails_the_model_load_naming_it(tmp_path):
    wheel_install()
    repo = copy_models(["preprocessing"], tmp_path / "repo", TOKENIZER_FILES)
    config = repo / "preprocessing" / "config.pbtxt"
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("hybrid_llm/1/tiny_qwen3_5", "missing_dir"), encoding="utf-8")
    server = start_server(repo, *free_ports(3), log_path=tmp_path / "server.log")
    try:
        with pytest.raises(RuntimeError, match="exited with code 1") as exc:
            server.wait_ready(60)
    finally:
        server.stop()
    assert "parameter tokenizer_dir='missing_dir'" in str(exc.value)


def test_ready_means_the_metrics_page_is_served_too(llm_server):
    """tritonserver starts its metrics service after the HTTP one: `is_ready` (and so
    `wait_ready`) waits for both, so a client may read metrics as soon as it returns."""
    from backend.triton.server import ServerHandle, ServerPorts

    assert llm_server.is_ready()
    (closed,) = free_ports(1)  # nothing listens there
    ports = ServerPorts(llm_server.ports.http, llm_server.ports.grpc, closed)
    half = ServerHandle(llm_server.process, llm_server.install, ports, "127.0.0.1",
                        llm_server.workdir, None)
    assert not half.is_ready()  # HTTP ready, metrics closed
    with pytest.raises(TimeoutError, match="not ready"):
        half.wait_ready(timeout=0.5, poll_s=0.1)


def test_processes_a_dead_server_left_behind_are_killed_with_it(tmp_path):
    """A server that dies without stopping its backend stubs (a port taken at start-up, a
    crash) leaves them running in its process group, holding memory and ignoring SIGTERM:
    `wait` kills them. Here a stand-in 'server' starts such a child and exits."""
    from backend.triton.server import ServerHandle, ServerPorts, orphans_of_group

    child = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "print(os.getpid(), flush=True); time.sleep(120)")  # its pid once it ignores
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE,
                               start_new_session=True, text=True)
    stub = int(process.stdout.readline())
    process.stdout.close()
    handle = ServerHandle(process, None, ServerPorts(1, 2, 3), "127.0.0.1", tmp_path / "w", None)
    process.wait()  # reaped, as `is_alive` does when it sees the server gone
    assert orphans_of_group(process.pid) == [stub]
    os.kill(stub, signal.SIGTERM)  # ignored
    time.sleep(0.2)
    assert orphans_of_group(process.pid) == [stub]
    handle.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and orphans_of_group(process.pid):
        time.sleep(0.05)
    assert orphans_of_group(process.pid) == []  # gone, or a zombie until init reaps it


def _deaf_server(tmp_path):
    """A stand-in 'server' that ignores SIGINT and SIGTERM (as a tritonserver already
    shutting down may), in its own session."""
    from backend.triton.server import ServerHandle, ServerPorts

    code = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(120)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               start_new_session=True, text=True)
    assert process.stdout.readline() == "up\n"
    process.stdout.close()
    return ServerHandle(process, None, ServerPorts(1, 2, 3), "127.0.0.1", tmp_path / "w", None)


def test_a_stop_interrupted_by_ctrl_c_kills_the_server(tmp_path, monkeypatch):
    """A second Ctrl-C while `stop` waits out the server's shutdown must not leave it
    running: it is killed, then the interrupt goes on."""
    handle = _deaf_server(tmp_path)
    real_wait = handle.process.wait

    def interrupted_wait(timeout=None):
        if timeout is not None:  # the shutdown wait: Ctrl-C arrives
            raise KeyboardInterrupt
        return real_wait()

    monkeypatch.setattr(handle.process, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        handle.stop(timeout=30)
    assert handle.process.poll() == -signal.SIGKILL


def test_servers_a_benchmark_leaves_behind_are_killed_at_exit(tmp_path):
    """`client.bench.serving` kills at interpreter exit the servers it started and did not
    stop (an interrupted run: a background stop cut short, a start reached by Ctrl-C)."""
    from client.bench import serving

    handle = _deaf_server(tmp_path)
    serving._started.add(handle)
    try:
        serving.kill_unstopped_servers()
        assert handle.process.poll() == -signal.SIGKILL
        assert handle not in serving._started
    finally:
        handle.kill()
        serving._started.discard(handle)
