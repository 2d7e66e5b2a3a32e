"""LoRA adapters' cost: the same requests on the base model, all on one adapter, and mixed
(half on the base model, a quarter on each of two adapters) in one in-process engine.

Each round sends `--requests` distinct prompts of `--prompt-len` tokens at once (greedy,
`--max-tokens` tokens each) and waits for all of them; the prefix cache is reset between
rounds, so every round prefills cold. The cases rotate round by round (the host's noise
lands on each alike); reported per case, as medians over `--repeats` rounds: time to the
last request's first token, mean TTFT, the whole round's time and decode tokens/s.
Requests on an adapter run the same layers (the fused CPU decode path included) with the
adapter's low-rank terms added (`backend/model/lora.py`).

    python -m client.bench.lora [--rank 16] [--requests 8] [--repeats 5]
Writes client/bench/results/lora/summary.json and lora.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from client.bench.common import (
    DEFAULT_MODEL,
    OutputTimes,
    bench_main,
    config_of,
    machine,
    median_row,
    pyplot,
    save_figure,
)

RESULTS = Path(__file__).resolve().parent / "results" / "lora"
CASES = ("base", "one_adapter", "mixed")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
           "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    return p.parse_args(argv)


def random_adapter(model, path: Path, rank: int, seed: int) -> Path:
    """A random adapter of every TARGETS layer of `model` (the default model's names are
    the checkpoint's)."""
    from backend.model.linear import Linear
    from backend.model.lora import save_adapter

    g = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(rank, m.in_features, generator=g) * 0.02,
                      torch.randn(m.out_features, rank, generator=g) * 0.02)
               for name, m in model.named_modules()
               if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in TARGETS}
    return save_adapter(path, weights, alpha=2.0 * rank)


def one_round(engine, prompts: list[list[int]], names: list[str | None],
              max_tokens: int) -> dict[str, float]:
    from backend.engine import SamplingParams
    from backend.engine.request import Request

    times = OutputTimes()
    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, top_k=1)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.submit(Request(f"r{i}-{start}", prompt, sampling, lora_name=name,
                              on_output=times.on_output))
    while engine.has_work:
        engine.step()
    end = time.perf_counter()
    ttfts = [t - start for t in times.first.values()]
    return {"last_first_token_s": max(ttfts), "ttft_mean_s": sum(ttfts) / len(ttfts),
            "round_s": end - start, "decode_tokens_per_second": times.decode_tokens_per_s()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from backend.engine import Engine, EngineConfig

    engine = Engine.from_model_dir(args.model, EngineConfig(max_num_seqs=args.requests))
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(("a", "b")):
            engine.load_lora(name, random_adapter(engine.model, Path(tmp) / name, args.rank, i))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    n = args.requests
    names = {"base": [None] * n, "one_adapter": ["a"] * n,
             "mixed": [None] * (n // 2) + ["a"] * (n // 4) + ["b"] * (n - n // 2 - n // 4)}
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
    one_round(engine, [torch.randint(4, vocab, (64,), generator=g).tolist()] * 2,
              ["a", None], 4)  # warm-up
    for r in tqdm(range(args.repeats * len(CASES)), desc="lora rounds"):
        case = CASES[(r + r // len(CASES)) % len(CASES)]  # rotating order
        prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist()
                   for _ in range(n)]
        engine.reset_prefix_cache()
        rows[case].append(one_round(engine, prompts, names[case], args.max_tokens))
    medians = {c: median_row(rows[c]) for c in CASES}
    base = medians["base"]
    summary = {
        "benchmark": "lora", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
        "config": config_of(args), "cases": medians,
        "adapter_layers": len(engine._adapters[engine.adapters["a"]].weights),
        "decode_throughput_vs_base": {c: round(medians[c]["decode_tokens_per_second"]
                                               / base["decode_tokens_per_second"], 3)
                                      for c in CASES},
        "round_time_vs_base": {c: round(medians[c]["round_ms"] / base["round_ms"], 3)
                               for c in CASES},
    }
    plot(medians, args.out.parent / "lora.png", args)
    return summary


def plot(medians: dict[str, dict[str, float]], path: Path, args) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = list(medians)
    axes[0].bar(labels, [medians[c]["ttft_mean_ms"] for c in labels], color="#4c72b0")
    axes[0].set_ylabel("mean TTFT (ms)")
    axes[1].bar(labels, [medians[c]["decode_tokens_per_second"] for c in labels], color="#dd8452")
    axes[1].set_ylabel("decode tokens/s")
    fig.suptitle(f"LoRA rank {args.rank}: {args.requests} requests x {args.prompt_len} tokens "
                 f"at once (medians of {args.repeats})")
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return bench_main(parse_args, run, argv)


if __name__ == "__main__":
    main()
