"""Temporary copies of the model repository with chosen parameters (tests and benchmarks).

`copy_models` copies model folders; `set_parameters` / `read_parameters` edit and read the
string `parameters` of a config.pbtxt (the form this repository writes them in);
`ensure_default_model` puts a randomly initialised model of the default architecture where the
trained one is missing, so serving can be exercised on a checkout without trained weights.
"""

from __future__ import annotations

import re
import shutil
import socket
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

from backend.triton.install import PROJECT_ROOT

MODEL_REPO = PROJECT_ROOT / "model_repo"
DEFAULT_MODEL = "hybrid_llm/1/tiny_qwen3_5"
# Files other models point at: the default tokenizer that lives beside the default model.
TOKENIZER_FILES = (f"{DEFAULT_MODEL}/tokenizer.json", f"{DEFAULT_MODEL}/tokenizer_config.json")
_PARAM = r'(key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*")([^"]*)"'


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free on loopback (held open together so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def copy_models(
    models: Sequence[str], dest: Path, extra_files: Sequence[str], source: Path = MODEL_REPO
) -> Path:
    for model in models:
        shutil.copytree(source / model, dest / model, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in extra_files:
        target = dest / rel
        if not target.exists() and (source / rel).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, target)
    return dest


def set_parameters(config: Path, params: Mapping[str, str]) -> None:
    """Sets string parameters in a config.pbtxt (replacing the value, or adding the key)."""
    text = config.read_text()
    for key, value in params.items():
        if any(ch in value for ch in '"\\\n'):
            raise ValueError(f"parameter {key}: {value!r} holds a quote, a backslash or a "
                             "newline, which a config.pbtxt string value cannot carry as is")
        pattern = re.compile(_PARAM.format(key=re.escape(key)))
        text, count = pattern.subn(lambda m, v=value: m.group(1) + v + '"', text)
        if not count:
            text += f'\nparameters {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}\n'
    config.write_text(text)


def read_parameters(config: Path) -> dict[str, str]:
    """The string parameters of a config.pbtxt (empty values included)."""
    pattern = re.compile(_PARAM.format(key=r'([^"]+)'))
    return {m.group(2): m.group(3) for m in pattern.finditer(config.read_text())}


def ensure_default_model(repo: Path) -> bool:
    """Writes a random tiny model where the default one is missing; True if it did."""
    target = repo / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return False
    from backend.model.hybrid import HybridForCausalLM
    from engine_build.hf_export import save_hf_directory
    from engine_build.train_tiny import init_weights, tiny_config

    model = HybridForCausalLM(tiny_config())
    init_weights(model, seed=0)
    save_hf_directory(model, target)
    return True
