from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "model"))

# Two cores: keep intra-op threads fixed so timings and results are repeatable.
torch.set_num_threads(2)
