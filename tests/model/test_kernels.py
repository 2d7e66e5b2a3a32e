"""Kernel selection: the CPU path never imports GPU-only packages."""

from __future__ import annotations

import subprocess
import sys

import torch

from backend.model.delta_rule import chunk_gated_delta_rule, gated_delta_step
from backend.model.kernels import delta_rule_for


def test_cpu_tensors_use_the_pytorch_forms():
    x = torch.zeros(1)
    assert delta_rule_for(x, 1) is gated_delta_step
    assert delta_rule_for(x, 17) is chunk_gated_delta_rule


def test_a_cpu_forward_imports_no_gpu_package():
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, 'tests/model')\n"
        "from hf_oracle import make_hf_checkpoint\n"
        "import tempfile; d = tempfile.mkdtemp(); make_hf_checkpoint(d, seed=1)\n"
        "from backend.model import load_model\n"
        "from backend.cache.file_io import probe_kvikio\n"
        "m = load_model(d); m.logits(torch.zeros(1, 70, dtype=torch.long))\n"
        "assert not probe_kvikio().available\n"
        "bad = [n for n in ('fla', 'kvikio', 'cupy') if n in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
