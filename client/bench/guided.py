"""Guided decoding's cost: decode throughput of guided requests against unguided ones on the
same engine, the grammar's per-token work alone, and compile times, at the model's vocabulary
and at a Qwen3.5-sized one (151,936 tokens, synthetic byte-level strings).

Engine runs (in-process, the default model): B requests at once, each generating exactly N
tokens: unguided (min_tokens = N), a regex that allows any N lower-case letters or spaces, and
a JSON schema of fixed-size fields (outputs of about 118 tokens: the batch stays whole), with
jump-forward (the tokens the grammar forces join without a decode step each) and without it
(`guided_jump_forward` off: a step a token).
Each way runs `--repeats` times in rotating order on a fresh cache namespace; medians are
reported (on two shared cores single runs spread by +-25%: the grammar's own time is the
steadier number). The per-token grammar work (accept the token, compute the next mask) is timed
alone on the same guides, for both vocabularies.

    python -m client.bench.guided [--batch 8] [--max-tokens 128] [--repeats 5]
Writes client/bench/results/guided/summary.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from backend.engine import Engine, EngineConfig, Request, SamplingParams
from backend.engine.guided import GrammarBackend, Guide
from backend.tokenizer import Tokenizer
from client.bench.common import DEFAULT_MODEL, OutputTimes, bench_main, config_of, machine

RESULTS = Path(__file__).resolve().parent / "results" / "guided"
QWEN_VOCAB = 151_936
PROMPT = '# settings\nuser = {"name": "alice", "city": "paris", "age": 31}\nitem = '
# Fields of fixed sizes: every output is about 118 tokens (compact JSON), so the batch stays
# whole to its end as the other ways' does.
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 16, "maxLength": 16},
                   "city": {"type": "string", "minLength": 16, "maxLength": 16},
                   "age": {"type": "integer", "minimum": 100, "maximum": 150},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                            "minItems": 8, "maxItems": 8}},
    "required": ["name", "city", "age", "tags"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--large-vocab", type=int, default=QWEN_VOCAB,
                   help="size of the synthetic vocabulary the grammar work is also timed on")
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def guides(max_tokens: int) -> dict[str, Guide | None]:
    """The ways an engine run is measured (`json_schema_no_jump`: the schema on an engine
    with `guided_jump_forward` off, one decode step a token)."""
    schema = Guide("json_schema", json.dumps(SCHEMA))
    return {"unguided": None, "regex": Guide("regex", f"[a-z ]{{{max_tokens}}}"),
            "json_schema": schema, "json_schema_no_jump": schema}


def engine_run(engine: Engine, prompt: list[int], guide: Guide | None,
               args: argparse.Namespace) -> dict[str, float]:
    """B requests at once from a cold prefix: output tokens per second after the first
    token of each (the decode phase), the mean time from submission to a request's end, the
    engine steps, and the tokens generated."""
    salt = uuid.uuid4().hex
    times = OutputTimes()
    min_tokens = args.max_tokens if guide is None else 0
    steps = engine.stats()["steps"]
    submitted = time.perf_counter()
    for i in range(args.batch):
        engine.submit(Request(f"{salt}-{i}", prompt, SamplingParams(
            max_tokens=args.max_tokens, min_tokens=min_tokens, temperature=1.0, seed=i,
            guide=guide), cache_salt=salt, on_output=times.on_output))
    while len(times.done) < args.batch:
        engine.step()
    return {"decode_tokens_per_s": times.decode_tokens_per_s(),
            "request_done_ms": 1000 * statistics.mean(t - submitted
                                                      for t in times.last.values()),
            "steps": engine.stats()["steps"] - steps,
            "output_tokens": sum(times.counts.values())}


def mask_cost(backend: GrammarBackend, guide: Guide, steps: int, seed: int = 0) -> float:
    """Seconds per token of the grammar's own work (accept the token, compute the next
    mask, apply it to a row of logits), walking random allowed tokens for up to `steps`
    tokens."""
    rng = random.Random(seed)
    state = backend.state(guide, None)
    times = []
    for _ in range(steps):
        choices = state.allowed.nonzero().view(-1).tolist()
        if not state.continues or not choices:
            break
        token = rng.choice(choices)
        row = torch.zeros(backend.vocab_size)
        t0 = time.perf_counter()
        state.accept(token)
        state.apply(row)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE vocabulary of `vocab_size` tokens: the 256 bytes, then distinct
    strings of 2-10 ASCII letters, digits, spaces and punctuation (Qwen3.5's size)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from backend.tokenizer import bytes_to_unicode

    rng = random.Random(seed)
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 ,.:\"{}[]_-"
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 10)))
        vocab.setdefault("".join(byte_chars[b] for b in word.encode()), len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return Tokenizer(tok, "<|endoftext|>")


def timed_compile(backend: GrammarBackend, guide: Guide) -> float:
    t0 = time.perf_counter()
    backend.compile(guide)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine.from_model_dir(args.model, EngineConfig())
    stepwise = Engine.from_model_dir(args.model, EngineConfig(guided_jump_forward=False))
    prompt = engine.tokenizer.encode(PROMPT)
    ways = guides(args.max_tokens)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    names = list(ways)
    for warm in (engine, stepwise):
        engine_run(warm, prompt, ways["json_schema"], args)
    for r in tqdm(range(args.repeats), desc="engine runs"):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runner = stepwise if name == "json_schema_no_jump" else engine
            runs[name].append(engine_run(runner, prompt, ways[name], args))

    def median(key: str, digits: int = 1) -> dict[str, float]:
        return {name: round(statistics.median(x[key] for x in rows), digits)
                for name, rows in runs.items()}

    throughput = median("decode_tokens_per_s")
    vocabularies = {"model": GrammarBackend(engine.tokenizer, engine.model_config.vocab_size)}
    big = synthetic_tokenizer(args.large_vocab)
    vocabularies["large"] = GrammarBackend(big, args.large_vocab)
    costs: dict[str, dict[str, float]] = {}
    for vocab, backend in tqdm(vocabularies.items(), desc="grammar work"):
        entry: dict[str, float] = {"vocab_size": backend.vocab_size}
        for name in ("regex", "json_schema"):
            guide = ways[name]
            assert guide is not None
            entry[f"{name}_compile_ms"] = round(timed_compile(backend, guide) * 1000, 2)
            entry[f"{name}_compile_cached_ms"] = round(timed_compile(backend, guide) * 1000, 3)
            entry[f"{name}_per_token_us"] = round(mask_cost(backend, guide, 128) * 1e6, 1)
        costs[vocab] = entry
    step_us = 1e6 * args.batch / throughput["unguided"]
    return {
        "decode_tokens_per_s": throughput,
        "guided_over_unguided": {name: round(throughput[name] / throughput["unguided"], 3)
                                 for name in ways if name != "unguided"},
        "jump_forward": {
            "request_done_ms": {k: v for k, v in median("request_done_ms").items()
                                if k.startswith("json")},
            "steps": {k: v for k, v in median("steps", 0).items() if k.startswith("json")},
            "speedup": round(statistics.median(x["request_done_ms"]
                                               for x in runs["json_schema_no_jump"])
                             / statistics.median(x["request_done_ms"]
                                                 for x in runs["json_schema"]), 3),
        },
        "output_tokens": median("output_tokens", 0),
        "grammar_work": costs,
        "unguided_step_us": round(step_us, 1),
        "config": config_of(args),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
