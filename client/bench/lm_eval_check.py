"""EleutherAI's lm-evaluation-harness against the served model, checked against transformers.

Runs lm-eval (its command line, from its own environment: `make lm-eval-venv`) through the
OpenAI frontend in front of a real tritonserver on the default model, with its two API
models: `local-completions` for every request type lm-eval has (loglikelihood, multiple
choice, loglikelihood_rolling: prompts sent as token ids with `echo` and `logprobs`,
`max_tokens` 1; generate_until: greedy with stop strings) and `local-chat-completions` for
generate_until through the chat template. The tasks are written here (deterministic word
sequences, `--docs` of them, a local JSON file: nothing is downloaded). Then each answer
lm-eval scored is computed again by the oracle, `transformers`' Qwen3_5ForCausalLM on the
same checkpoint: every continuation's summed log probability and whether it is the greedy
one, every rolling log likelihood, and every (chat) completion's greedy text (cut at the
task's stop strings), so a frontend or server that returned wrong numbers, or in the wrong
layout, fails the check.

    make lm-eval-venv && python -m client.bench.lm_eval_check [--docs 12] [--tolerance 1e-3]
Writes client/bench/results/lm_eval/summary.json (lm-eval's metrics and the largest
differences from the oracle); exits 1 where the check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from client.bench.common import config_of, machine, write_summary
from client.bench.openai_frontend import frontend
from client.bench.serving import served_repository

RESULTS = Path(__file__).resolve().parent / "results" / "lm_eval"
WORDS = ("the cat sat on a mat and the dog ran to the park where children play with a red "
         "ball in the sun").split()
STOPS = ["\n", "."]
MAX_GEN = 8
COMPLETION_TASKS = ("tiny_ll", "tiny_mc", "tiny_roll", "tiny_gen")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=12, help="documents in each task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lm-eval", default=".venv-eval/bin/lm_eval",
                   help="lm-eval's command (its own environment: `make lm-eval-venv`; its "
                        "dependencies want a newer numpy than the server's)")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="the largest |served - transformers| log likelihood accepted")
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def write_tasks(folder: Path, docs: int, seed: int) -> None:
    """The data (one JSON line a document) and four task YAMLs, one per request type."""
    rng = random.Random(seed)
    with open(folder / "data.jsonl", "w") as out:
        for _ in range(docs):
            context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
            target = rng.choice(WORDS)
            out.write(json.dumps({"context": context, "target": target,
                                  "choices": [target, "zebra", "quantum"], "label": 0}) + "\n")
    data = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
            f"{folder / 'data.jsonl'}\ntest_split: test\n")
    tasks = {
        "tiny_ll": 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\n'
                   'doc_to_target: " {{target}}"\nmetric_list:\n  - metric: perplexity\n'
                   '  - metric: acc\n',
        "tiny_mc": 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\n'
                   'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
                   'target_delimiter: " "\nmetric_list:\n  - metric: acc\n',
        "tiny_roll": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                     'doc_to_target: "{{context}}"\nmetric_list:\n  - metric: word_perplexity\n',
        "tiny_gen": 'output_type: generate_until\ndoc_to_text: "{{context}}"\n'
                    'doc_to_target: " {{target}}"\ngeneration_kwargs:\n'
                    f'  until: {json.dumps(STOPS)}\n  max_gen_toks: {MAX_GEN}\n'
                    '  do_sample: false\nmetric_list:\n  - metric: exact_match\n'
                    '    higher_is_better: true\n',
    }
    for name, body in tasks.items():
        (folder / f"{name}.yaml").write_text(f"task: {name}\n{data}{body}")


def evaluate(lm_eval: str, model: str, base: str, tokenizer_dir: Path, folder: Path,
             tasks: list[str], chat: bool = False) -> tuple[dict[str, Any], dict[str, list]]:
    """lm-eval's command line (`lm_eval`, in its own environment) on `tasks`: its results
    and, per task, its logged samples."""
    args = {"model": "ensemble", "num_concurrent": 2, "max_retries": 1,
            "base_url": f"{base}/{'chat/completions' if chat else 'completions'}"}
    if not chat:
        args |= {"tokenizer": str(tokenizer_dir), "tokenizer_backend": "huggingface"}
    out = folder / ("out_chat" if chat else "out")
    command = [lm_eval, "--model", model,
               "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
               "--include_path", str(folder), "--tasks", ",".join(tasks),
               "--output_path", str(out), "--log_samples"]
    if chat:
        command.append("--apply_chat_template")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({done.returncode}):\n{done.stderr[-4000:]}")
    [results] = out.rglob("results_*.json")
    samples = {task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl"))
                      .read_text().splitlines()] for task in tasks}
    return json.loads(results.read_text()), samples


class Oracle:
    """transformers on the checkpoint the server serves."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen3_5ForCausalLM

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def scores(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """The continuation's summed log probability after the context, and whether each of
        its tokens is the likeliest."""
        with self.torch.no_grad():
            ids = self.torch.tensor([context + continuation])
            rows = self.model(ids).logits.log_softmax(-1)[0, len(context) - 1:-1]
        picked = rows[self.torch.arange(len(continuation)), continuation]
        return float(picked.sum()), bool((rows.argmax(-1) == self.torch.tensor(continuation)).all())

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt of a chat, by the checkpoint's own chat template (transformers')."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def greedy(self, ids: list[int]) -> str:
        with self.torch.no_grad():
            out = self.model.generate(self.torch.tensor([ids]), max_new_tokens=MAX_GEN,
                                      do_sample=False)
        text = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        for stop in STOPS:
            text = text.split(stop)[0]
        return text


def _args(sample: dict[str, Any]) -> list[tuple]:
    """A sample's requests' arguments, as lm-eval's logger writes them ({"gen_args_0":
    {"arg_0": ..., "arg_1": ...}, ...})."""
    return [tuple(a.values()) for a in sample["arguments"].values()]


def _flag(value: Any) -> bool:
    return value is True or value == "True"


def check(oracle: Oracle, samples: dict[str, list], chat_samples: list) -> dict[str, Any]:
    """Each scored answer against the oracle: differences and mismatches."""
    worst, greedy_mismatch, scored = 0.0, 0, 0
    for task in ("tiny_ll", "tiny_mc"):
        for sample in samples[task]:
            for (context, continuation), resp in zip(_args(sample), sample["resps"]):
                got, greedy = resp[0]
                ref, ref_greedy = oracle.scores(oracle.encode(context),
                                                oracle.encode(continuation))
                worst = max(worst, abs(float(got) - ref))
                greedy_mismatch += _flag(greedy) != ref_greedy
                scored += 1
    prefix = oracle.tokenizer.bos_token_id
    prefix = oracle.tokenizer.eos_token_id if prefix is None else prefix
    worst_rolling = 0.0
    for sample in samples["tiny_roll"]:
        (text,) = _args(sample)[0][:1]
        got = float(sample["resps"][0][0])
        ref, _ = oracle.scores([prefix], oracle.encode(text))
        worst_rolling = max(worst_rolling, abs(got - ref))
    text_mismatch = []
    for sample in samples["tiny_gen"]:
        context = _args(sample)[0][0]
        if oracle.greedy(oracle.encode(context)) != sample["resps"][0][0]:
            text_mismatch.append(context)
    chat_mismatch = []
    for sample in chat_samples:
        chat = _args(sample)[0][0]  # the messages as a JSON string (in a list)
        messages = json.loads(chat[0] if isinstance(chat, list) else chat)
        if oracle.greedy(oracle.chat_ids(messages)) != sample["resps"][0][0]:
            chat_mismatch.append(messages[-1]["content"])
    return {"loglikelihoods": scored, "max_abs_loglikelihood_diff": worst,
            "greedy_flag_mismatches": greedy_mismatch,
            "rolling_docs": len(samples["tiny_roll"]),
            "max_abs_rolling_diff": worst_rolling,
            "generations": len(samples["tiny_gen"]), "generation_mismatches": text_mismatch,
            "chat_generations": len(chat_samples), "chat_generation_mismatches": chat_mismatch}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from backend.triton.repo import free_ports

    lm_eval = shutil.which(args.lm_eval)
    if lm_eval is None:
        raise SystemExit(f"no lm_eval at {args.lm_eval}: `make lm-eval-venv` makes one")
    version = subprocess.run([str(Path(lm_eval).parent / "python"), "-c",
                              "import lm_eval; print(lm_eval.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as tmp:
        folder = Path(tmp)
        write_tasks(folder, args.docs, args.seed)
        with served_repository() as server:
            model_dir = server.model_repository / "hybrid_llm" / "1" / "tiny_qwen3_5"
            [port] = free_ports(1)
            with frontend(server.urls.grpc, str(server.model_repository), port) as base:
                results, samples = evaluate(lm_eval, "local-completions", base, model_dir,
                                            folder, list(COMPLETION_TASKS))
                chat, chat_samples = evaluate(lm_eval, "local-chat-completions", base,
                                              model_dir, folder, ["tiny_gen"], chat=True)
            oracle = Oracle(model_dir)
            found = check(oracle, samples, chat_samples["tiny_gen"])
    metrics = {task: {k: v for k, v in values.items() if isinstance(v, (int, float))}
               for task, values in results["results"].items()}
    metrics["tiny_gen_chat"] = {k: v for k, v in chat["results"]["tiny_gen"].items()
                                if isinstance(v, (int, float))}
    ok = (found["max_abs_loglikelihood_diff"] <= args.tolerance
          and found["max_abs_rolling_diff"] <= args.tolerance
          and found["greedy_flag_mismatches"] == 0 and not found["generation_mismatches"]
          and found["chat_generations"] == args.docs
          and not found["chat_generation_mismatches"])
    return {"benchmark": "lm_eval_check", "lm_eval_version": version,
            "config": config_of(args), "machine": machine(), "metrics": metrics,
            "oracle": found, "passed": ok}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    write_summary(args.out, summary)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
