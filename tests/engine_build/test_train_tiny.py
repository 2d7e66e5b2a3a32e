"""The training script runs, lowers the loss, resumes, and writes a loadable HF directory."""

from __future__ import annotations

import json
import re

import pytest
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


def test_param_groups_decay_matrices_only_and_single_out_qk_norms():
    from backend.model import HybridForCausalLM
    from engine_build.train_tiny import init_weights, param_groups, tiny_config

    model = HybridForCausalLM(tiny_config(hidden=64, layers=4))
    init_weights(model, seed=0, qk_gain=2.0)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay, qk = param_groups(model, qk_norm_lr_mult=10.0)
    assert all(p.dim() >= 2 for p in decay["params"])
    assert "weight_decay" not in decay  # AdamW's default (0.1 in train) applies
    assert no_decay["weight_decay"] == qk["weight_decay"] == 0.0
    assert qk["lr_mult"] == 10.0 and len(qk["params"]) == 2  # one attention layer: q and k
    assert all(names[id(p)].endswith(("q_norm.weight", "k_norm.weight")) for p in qk["params"])
    assert any(names[id(p)].endswith("A_log") for p in no_decay["params"])
    total = sum(len(g["params"]) for g in (decay, no_decay, qk))
    assert total == len(list(model.parameters()))
    # A gain of 2 is stored as w = 1 in the zero-centred norm; other norms stay at identity.
    for n, p in model.named_parameters():
        if n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            assert torch.equal(p, torch.ones_like(p)), n
        elif n.endswith("layernorm.weight"):
            assert torch.equal(p, torch.zeros_like(p)), n


def test_nemotron_h_family_trains_and_exports_what_transformers_loads(tmp_path, monkeypatch):
    """`--family nemotron_h`: a few steps lower the loss; the written directory (NVIDIA's
    config layout, `hybrid_override_pattern`) loads in transformers with the same logits."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr("engine_build.train_tiny.PHASES", ((0.0, 128),))
    args = _args(tmp_path, 10)
    args.family, args.dt_init = "nemotron_h", "log-uniform"
    out = train(args)
    history = json.loads((tmp_path / "work" / "loss_history.json").read_text())
    assert sum(h["loss"] for h in history[-3:]) < sum(h["loss"] for h in history[:3]) - 0.9
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "nemotron_h" and raw["hybrid_override_pattern"] == "M-M-M*-"
    ours = load_model(out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 260, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
    assert (ours.logits(ids) - want).abs().max() <= 1e-4 * want.abs().max()


def test_arguments_that_cannot_train_are_usage_errors(tmp_path, capsys):
    """Each failed deep in a run with a traceback (threads 0, an unknown task, NaN learning
    rate, a malformed schedule) or ran wrongly without a word (--steps 0 wrote an untrained
    model, a task fraction of 2): now exit 2 with what is wrong, before any work."""
    base = ["--out", str(tmp_path / "m"), "--work-dir", str(tmp_path / "w")]
    for extra, message in ((["--threads", "0"], "--threads must be >= 1"),
                           (["--tasks", "kv,bogus"], "--tasks must be a comma-separated list"),
                           (["--lr", "nan"], "--lr must be a number > 0, got nan"),
                           (["--phases", "0.5"], '--phases "FRACTION:LENGTH,...", got'),
                           (["--phases", "2:512"], r"FRACTION in \[0, 1\]"),
                           (["--task-context", "90:10"], "1 <= MIN <= MAX"),
                           (["--steps", "0"], "--steps must be >= 1, got 0"),
                           (["--task-fraction", "2"], r"--task-fraction must be in \[0, 1\]")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(base + extra)
        assert exit_.value.code == 2
        assert re.search(message, capsys.readouterr().err), extra
    assert not (tmp_path / "m").exists() and not (tmp_path / "w").exists()
