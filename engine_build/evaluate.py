"""Quality of a model directory with a plain full prefill: held-out bits per byte on the
standard library's held-out files, exact-match accuracy on the synthetic long-context
tasks at several context lengths, and sampled completions of a few code prompts.

    python -m engine_build.evaluate --model model_repo/hybrid_llm/1/tiny_qwen3_5 [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from backend.engine.request import SamplingParams
from backend.engine.sampling import make_generator, sample
from backend.model import HybridForCausalLM, load_model
from engine_build.corpus import load_split, to_ids
from engine_build.tasks import TASKS, TaskExample, make_example

CONTEXT_LENS = (512, 1024, 2048, 4096)
SAMPLE_PROMPTS = ("import os\nimport sys\n\n\ndef main(argv):\n",
                  "class Stack:\n    def __init__(self):\n",
                  "    for i in range(len(items)):\n")


@torch.inference_mode()
def sample_completion(model: HybridForCausalLM, prompt: str, max_new: int = 160,
                      temperature: float = 0.7, top_k: int = 20, seed: int = 1) -> str:
    """The engine's sampler over a full prefill per step (short texts; the card's samples),
    byte tokens only (the special tokens are banned words)."""
    special = tuple((i,) for i in range(256, model.config.vocab_size))
    params = SamplingParams(max_tokens=max_new, temperature=temperature, top_k=top_k,
                            seed=seed, bad_words=special)
    gen = make_generator(seed)
    ids = list(prompt.encode())
    for n in range(max_new):
        logits = model.logits(torch.tensor([ids]))[:, -1]
        ids.append(int(sample(logits, [params], [gen], [n])[0]))
    return bytes(ids).decode("utf-8", errors="replace")


@torch.inference_mode()
def bits_per_byte(model: HybridForCausalLM, ids: torch.Tensor, window: int = 1024,
                  progress: bool = True) -> float:
    """Mean next-byte loss in bits over non-overlapping windows of `ids` [N]."""
    total, count = 0.0, 0
    starts = range(0, len(ids) - 1, window)
    for s in tqdm(starts, desc="bits/byte", disable=not progress, leave=False):
        chunk = ids[s:s + window + 1].unsqueeze(0)
        if chunk.shape[1] < 2:
            break
        logits = model.logits(chunk[:, :-1])
        nll = F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="sum")
        total += nll.item()
        count += chunk.shape[1] - 1
    return total / count / math.log(2)


def task_examples(kind: str, context_len: int, n: int, seed: int = 1234) -> list[TaskExample]:
    rng = random.Random(f"{seed}-{kind}-{context_len}")
    return [make_example(kind, context_len, rng) for _ in range(n)]


@torch.inference_mode()
def answer_correct(model: HybridForCausalLM, example: TaskExample) -> bool:
    """Teacher-forced exact match: every answer byte is the argmax (= greedy decoding)."""
    prompt, answer = list(example.prompt.encode()), list(example.answer.encode())
    ids = torch.tensor([prompt + answer])
    logits = model.logits(ids[:, :-1])[0, len(prompt) - 1:]
    return bool((logits.argmax(-1) == ids[0, len(prompt):]).all())


def task_accuracy(model: HybridForCausalLM, kind: str, context_len: int, n: int) -> float:
    examples = task_examples(kind, context_len, n)
    return sum(answer_correct(model, e) for e in examples) / n


def evaluate(model: HybridForCausalLM, heldout_bytes: int, num_examples: int,
             context_lens=CONTEXT_LENS) -> dict:
    heldout = to_ids(load_split(held_out=True, max_bytes=heldout_bytes)[:heldout_bytes])
    result = {"heldout_bytes": len(heldout), "bits_per_byte": bits_per_byte(model, heldout),
              "num_examples": num_examples, "tasks": {}}
    jobs = [(k, c) for k in TASKS for c in context_lens]
    for kind, ctx in tqdm(jobs, desc="tasks"):
        result["tasks"].setdefault(kind, {})[str(ctx)] = task_accuracy(model, kind, ctx,
                                                                        num_examples)
    result["samples"] = [sample_completion(model, p) for p in SAMPLE_PROMPTS]
    return result


def format_table(result: dict) -> str:
    lens = list(next(iter(result["tasks"].values())))
    lines = [f"held-out bits per byte: {result['bits_per_byte']:.3f} "
             f"({result['heldout_bytes']} bytes)",
             "task      " + "".join(f"{c:>8}" for c in lens)]
    for kind, accs in result["tasks"].items():
        lines.append(f"{kind:<10}" + "".join(f"{accs[c]:>8.0%}" for c in lens))
    for text in result.get("samples", []):
        lines += ["--- sample (temperature 0.7, top-k 20, seed 1) ---", text]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quick", action="store_true", help="small sample (a minute or two)")
    p.add_argument("--heldout-bytes", type=int, default=None)
    p.add_argument("--examples", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path (default: <model>/eval.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model = load_model(args.model)
    heldout = args.heldout_bytes or (32_768 if args.quick else 262_144)
    examples = args.examples or (8 if args.quick else 50)
    result = evaluate(model, heldout, examples)
    print(format_table(result))
    out = Path(args.out) if args.out else Path(args.model) / "eval.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
