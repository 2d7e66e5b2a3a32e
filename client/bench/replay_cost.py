"""Time to first token of a cache hit against the distance of the branch point from the last
checkpoint: suffix replay against the checkpoint baseline, same engine, one run.

A document is cached; then branches that share its first `cut` tokens (cut on a page boundary,
at distances 0..C from the checkpoint grid) and add a fixed new suffix are sent one at a time.
Suffix replay resumes at the cut itself (replay of k anchors); the checkpoint baseline resumes
at the last checkpoint and recomputes the distance, hence its saw-tooth.

    python -m client.bench.replay_cost [--quick] [--model DIR]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backend.cache.config import CacheConfig
from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.engine import apply_calibration
from backend.model import load_model
from backend.replay.budget import ReplayConfig
from client.bench.common import model_parser, pyplot, save_figure, write_summary
from engine_build.corpus import load_split, to_ids

RESULTS = Path(__file__).resolve().parent / "results" / "replay_cost"
INTERVAL, PAGE = 256, 64


def engine_for(model, policy: str, k_max: int | None) -> Engine:
    replay = ReplayConfig(k_max=k_max, live_state=False)
    cache = CacheConfig(page_size=PAGE, policy=policy, checkpoint_interval=INTERVAL,
                        num_kv_pages=512, num_checkpoint_slots=64)
    return Engine(model, EngineConfig(max_num_seqs=4, max_tokens_per_step=4096,
                                      max_context_len=8192, cache=cache, replay=replay))


def measure(engine: Engine, doc: list[int], cuts: list[int], suffix_len: int, repeats: int,
            bar) -> dict[int, dict]:
    one = SamplingParams(max_tokens=1, top_k=1)
    engine.generate(doc, one)  # cache the document (and the baseline's checkpoints)
    out = {}
    for cut in cuts:
        times, hits = [], []
        for r in range(repeats):
            fresh = [(t * 7 + r + cut) % 256 for t in doc[cut:cut + suffix_len]]
            res = engine.generate(doc[:cut] + fresh, one)
            times.append(res.ttft_s)
            hits.append(res.cached_tokens)
            bar.update(1)
        out[cut] = {"ttft_ms": 1000 * statistics.median(times), "cached_tokens": hits[0],
                    "recomputed_tokens": cut + suffix_len - hits[0]}
    return out


def main(argv: list[str] | None = None) -> dict:
    args = model_parser(__doc__).parse_args(argv)
    torch.set_num_threads(2)
    model = load_model(args.model)
    k_max = apply_calibration(args.model, EngineConfig.from_params({"k_max": "auto"})).replay.k_max
    base, suffix_len, repeats = (1024, 64, 3) if args.quick else (2048, 64, 5)
    doc = to_ids(load_split(held_out=True, max_bytes=4 * base))[: base + INTERVAL + 64].tolist()
    cuts = [base + d for d in range(0, INTERVAL + 1, PAGE)]
    if not args.quick:
        cuts += [base + INTERVAL + d for d in range(PAGE, INTERVAL // 2 + 1, PAGE)]
    results = {}
    with tqdm(total=2 * len(cuts) * repeats, desc="replay_cost") as bar:
        for policy in ("suffixreplay", "checkpoint"):
            results[policy] = measure(engine_for(model, policy, k_max), doc, cuts, suffix_len,
                                      repeats, bar)
    sr = [v["ttft_ms"] for v in results["suffixreplay"].values()]
    ck = [v["ttft_ms"] for v in results["checkpoint"].values()]
    summary = {
        "hit_ttft_max_over_min": max(sr) / min(sr),
        "checkpoint_hit_ttft_max_over_min": max(ck) / min(ck),
        "mean_ttft_ms": {"suffixreplay": statistics.mean(sr), "checkpoint": statistics.mean(ck)},
        "k_max": k_max, "interval": INTERVAL, "suffix_len": suffix_len, "repeats": repeats,
        "cuts": {p: {str(c): v for c, v in r.items()} for p, r in results.items()},
        "date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU (no GPU)",
    }
    write_summary(RESULTS / "summary.json", summary, echo=False)
    plot(results, RESULTS / "ttft_vs_checkpoint_distance.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "cuts"}, indent=2))
    return summary


def plot(results: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, rows in results.items():
        cuts = sorted(rows)
        ax.plot(cuts, [rows[c]["ttft_ms"] for c in cuts], marker="o", label=policy)
    for c in sorted(results["checkpoint"]):
        if c % INTERVAL == 0:
            ax.axvline(c, color="gray", ls=":", lw=0.8)
    ax.set(xlabel="branch point (tokens; dotted: checkpoint grid)", ylabel="hit TTFT (ms)",
           title="TTFT of a cache hit vs distance from the last checkpoint")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
