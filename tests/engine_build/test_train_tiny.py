"""The training script runs, lowers the loss, resumes, and writes a loadable HF directory."""

from __future__ import annotations

import json

import torch

from backend.model import load_model
from engine_build.train_tiny import parse_args, train


def _args(tmp_path, steps):
    return parse_args([
        "--out", str(tmp_path / "model"), "--work-dir", str(tmp_path / "work"),
        "--steps", str(steps), "--hidden", "64", "--layers", "4", "--batch-tokens", "1024",
        "--lr", "3e-3", "--warmup", "2", "--checkpoint-every", "6", "--max-corpus-bytes", "300000",
        "--resume",
    ])


def test_a_few_steps_lower_the_loss_and_resume(tmp_path, monkeypatch):
    # Short sequences for a quick test: every phase uses 128 tokens.
    monkeypatch.setattr("engine_build.train_tiny.PHASES", ((0.0, 128),))
    out = train(_args(tmp_path, 12))
    history = json.loads((tmp_path / "work" / "loss_history.json").read_text())
    first = sum(h["loss"] for h in history[:3]) / 3
    last = sum(h["loss"] for h in history[-3:]) / 3
    assert last < first - 0.3, (first, last)
    model = load_model(out)
    assert model.config.num_groups == 1 and model.config.vocab_size == 260
    assert (out / "loss_curve.png").stat().st_size > 1000
    # Resuming continues from step 12 instead of starting over.
    train(_args(tmp_path, 14))
    history = json.loads((tmp_path / "work" / "loss_history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 15))
    logits = model.logits(torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(logits).all()
