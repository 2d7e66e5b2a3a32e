"""What every benchmark shares: the default model's path, argument basics, writing results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "model_repo/hybrid_llm/1/tiny_qwen3_5"


def model_parser(doc: str) -> argparse.ArgumentParser:
    """`--model DIR` (default: the default model) and `--quick`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--quick", action="store_true")
    return p


def write_summary(path: Path, summary: dict[str, Any], echo: bool = True) -> Path:
    """Writes summary.json (creating its folder) and prints it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    if echo:
        print(json.dumps(summary, indent=2))
    return path
