"""The committed default model: loads in both loaders with the same logits, has not
regressed on a fixed held-out sample, and evaluate.py runs on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend.model import load_model
from backend.tokenizer import load_tokenizer
from engine_build import evaluate

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "model_repo/hybrid_llm/1/tiny_qwen3_5"
SAMPLE = ROOT / "tests/data/heldout_sample.py.txt"
# Measured bits per byte of the committed model on SAMPLE (1.682), plus 10%.
MAX_SAMPLE_BPB = 1.85
# Measured key-value retrieval accuracy at 1K bytes (20 examples): 100%; the goal is 80%.
MIN_KV_ACCURACY_1K = 0.8


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL_DIR)


def test_size_and_layout(model):
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 2**20
    cfg = model.config
    assert 5e6 <= sum(p.numel() for p in model.parameters()) <= 20e6
    assert cfg.num_hidden_layers >= 8 and cfg.num_groups >= 2
    assert all(len(g) == 3 for g in cfg.groups)


def test_transformers_loads_it_unchanged_with_the_same_logits(model):
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    ids = torch.tensor([list(b"import os\nimport sys\n\ndef main():\n    return 0\n")])
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(model.logits(ids), ref, atol=1e-4 * ref.abs().max().item(),
                               rtol=0)


def test_heldout_sample_loss_has_not_regressed(model):
    tok = load_tokenizer(MODEL_DIR)
    ids = torch.tensor([tok.encode(SAMPLE.read_text())])
    total, count = 0.0, 0
    for start in range(0, ids.shape[1] - 1, 1024):
        chunk = ids[:, start:start + 1025]
        logits = model.logits(chunk[:, :-1])[0]
        total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    bpb = total / count / math.log(2)
    assert bpb < MAX_SAMPLE_BPB, bpb


def test_key_value_retrieval_has_not_regressed(model):
    # The model retrieves from the far past: exact-match accuracy at 1K bytes of context on
    # the evaluation's own fixed examples, with room for noise.
    acc = evaluate.task_accuracy(model, "kv", 1024, 20)
    assert acc >= MIN_KV_ACCURACY_1K, acc


def test_evaluate_runs_on_a_small_sample(tmp_path):
    out = tmp_path / "eval.json"
    result = evaluate.main(["--model", str(MODEL_DIR), "--heldout-bytes", "2048",
                            "--examples", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["bits_per_byte"] == pytest.approx(result["bits_per_byte"])
    assert set(saved["tasks"]) == {"kv", "needle", "vars"}
    assert 0 < saved["bits_per_byte"] < 8
    assert [t[: len(p)] for t, p in zip(saved["samples"], evaluate.SAMPLE_PROMPTS)] == \
        list(evaluate.SAMPLE_PROMPTS)
    assert all(len(t) > len(p) + 100 for t, p in zip(saved["samples"], evaluate.SAMPLE_PROMPTS))
