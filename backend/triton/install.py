"""Find a real `tritonserver` and prepare what it needs to run this project's Python models.

Two installs are supported:

- a system install (the NGC container): `$TRITONSERVER` or `tritonserver` on PATH, with its own
  backends under /opt/tritonserver/backends and the container's Python;
- the binary shipped in the `nvidia-pytriton` wheel (CPU-only development machines). The wheel
  carries one Python backend stub per Python version in `python_backend_stubs/<X.Y>/`, while the
  Python backend looks for its stub beside `libtriton_python.so`. Like pytriton itself, we build a
  backend directory holding the backend files plus the stub matching the running interpreter;
  we symlink them into a temporary folder instead of copying the 30 MB tree.

How the stub's embedded Python finds the project (checked with the 3.11 stub):
it starts in isolated mode, so PYTHONPATH is ignored. It locates `python3` on PATH and takes
sys.prefix and site-packages from it (a venv's pyvenv.cfg is honoured), and it puts '' (the
server's working directory) first on sys.path. Hence `server_env` puts the interpreter's bin
folder first on PATH and the launcher starts the server in the project root, so model.py files
can `import backend`. The stub links `libpython3.X.so.1.0` by soname, so the interpreter's own
libpython (e.g. pyenv's) goes first on LD_LIBRARY_PATH; otherwise the system one would be mixed
with a different standard library.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import backend

PROJECT_ROOT = Path(backend.__file__).resolve().parent.parent
STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and, for the pytriton wheel, its bundled parts live."""

    binary: Path
    # Set only for the pytriton wheel: <wheel>/pytriton/tritonserver.
    wheel_root: Path | None = None

    @property
    def from_wheel(self) -> bool:
        return self.wheel_root is not None

    @property
    def libs_dir(self) -> Path | None:
        # auditwheel puts the binary's shared libraries beside the package.
        if self.wheel_root is None:
            return None
        return self.wheel_root.parent.parent / "nvidia_pytriton.libs"

    def stub_path(self, python_version: str) -> Path:
        """The wheel's Python backend stub built for `python_version` ("3.11")."""
        if self.wheel_root is None:
            raise ValueError(f"{self.binary} is a system install; it brings its own stub")
        stubs = self.wheel_root / "python_backend_stubs"
        stub = stubs / python_version / STUB_NAME
        if not stub.is_file():
            available = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
            raise FileNotFoundError(
                f"no Python backend stub for Python {python_version} in {stubs}; "
                f"available: {available}"
            )
        return stub


def find_tritonserver() -> TritonInstall:
    """`$TRITONSERVER`, else `tritonserver` on PATH, else the nvidia-pytriton wheel's binary."""
    explicit = os.environ.get("TRITONSERVER")
    if explicit:
        binary = Path(explicit)
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise FileNotFoundError(f"TRITONSERVER={explicit} is not an executable file")
        return _install_for(binary)
    on_path = shutil.which("tritonserver")
    if on_path:
        return _install_for(Path(on_path))
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "tritonserver not found: set TRITONSERVER, put tritonserver on PATH, "
            "or install the serve extras (pip install -e '.[serve]') for nvidia-pytriton"
        )
    binary = Path(spec.origin).parent / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        raise FileNotFoundError(f"the nvidia-pytriton wheel has no server binary at {binary}")
    return _install_for(binary)


def _install_for(binary: Path) -> TritonInstall:
    root = binary.resolve().parent.parent
    is_wheel = (root / "python_backend_stubs").is_dir()
    return TritonInstall(binary=binary, wheel_root=root if is_wheel else None)


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backend_dir(install: TritonInstall, workdir: Path) -> Path:
    """A `--backend-directory` whose python/ holds the wheel's backend and the matching stub."""
    assert install.wheel_root is not None, "only the wheel needs a prepared backend directory"
    python_dir = workdir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (install.wheel_root / "backends" / "python").iterdir():
        if src.is_file():
            (python_dir / src.name).symlink_to(src)
    (python_dir / STUB_NAME).symlink_to(install.stub_path(python_version()))
    return python_dir.parent


def libpython_dir() -> Path | None:
    """The folder of the running interpreter's shared libpython, if it was built shared."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    return Path(libdir) if libdir else None


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so the Python stubs run this interpreter with its venv."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = _prepend(str(Path(sys.executable).parent), env.get("PATH"))
    lib_dirs = [libpython_dir(), install.libs_dir]
    for lib_dir in reversed([d for d in lib_dirs if d is not None]):
        env["LD_LIBRARY_PATH"] = _prepend(str(lib_dir), env.get("LD_LIBRARY_PATH"))
    # Ignored by the wheel's isolated stub, but honoured by other Python backends.
    env["PYTHONPATH"] = _prepend(str(PROJECT_ROOT), env.get("PYTHONPATH"))
    return env


def _prepend(entry: str, current: str | None) -> str:
    return entry if not current else f"{entry}{os.pathsep}{current}"
