"""Picks the replay budget cap k_max (and, when asked, the anchor density) for a model.

For calibration sequences cut at several page boundaries, the linear states are rebuilt by
replaying the last k dense-tail anchors (k swept over powers of two), and compared with a full
prefill: per group, the relative error of the recurrent states; over a continuation of the
text, the next-token KL divergence and top-1 agreement. k_max is the smallest k whose top-1
agreement meets the target. With several `--anchors-per-page` values the densities are tried
cheapest first, stopping at the first that meets the target; where none does, the density and
k with the best agreement are chosen and `target_met` is false (models with long memories,
such as Mamba2 with slow decays, need denser anchors than Qwen3.5's Gated DeltaNet). Writes
<model>/calibration.json (read by the engine when the serving configuration says
`k_max: auto` / `anchor_density: auto`) and <model>/calibration.png, or into `--out DIR`
(`engine_build.build --calibrate` writes them into the repository it builds, leaving the
checkpoint as it is).

    python -m engine_build.calibrate --model model_repo/hybrid_llm/1/tiny_qwen3_5 [--quick]
    python -m engine_build.calibrate --model DIR --anchors-per-page 4 16
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from backend.model import HybridForCausalLM, load_model
from backend.replay.anchors import AnchorLayout
from backend.replay.reference import (
    anchor_positions,
    continuation_logits,
    exact_run,
    relative_state_error,
    replayed_states,
)
from engine_build.corpus import load_split, to_ids
from engine_build.tasks import make_example

KS = (4, 8, 16, 32, 64, 128, 256, 512)


def calibration_sequences(num: int, length: int, seed: int = 7) -> list[list[int]]:
    """Half standard-library text (training split), half key-value retrieval prompts."""
    rng = random.Random(seed)
    text = to_ids(load_split(held_out=False, max_bytes=4_000_000))
    seqs = []
    for i in range(num):
        if i % 2 == 0:
            start = rng.randrange(len(text) - length)
            seqs.append(text[start:start + length].tolist())
        else:
            ex = make_example("kv", length, rng)
            seqs.append(list(ex.text.encode())[:length])
    return seqs


@torch.inference_mode()
def sweep(model: HybridForCausalLM, seqs: list[list[int]], boundaries: list[int],
          continuation: int, layout: AnchorLayout, ks=KS) -> dict[int, dict]:
    groups = [[model.config.linear_layer_ids.index(i) for i in g]
              for g in model.config.group_state_layers]
    acc = {k: {"kl": [], "top1": [], "state_error": [[] for _ in groups]} for k in ks}
    jobs = [(s, j) for s in seqs for j in boundaries if j + continuation <= len(s)]
    for seq, j in tqdm(jobs, desc="calibrate"):
        session, exact = exact_run(model, seq, j, layout.page_size)
        suffix = seq[j:j + continuation]
        ref = continuation_logits(session, exact, suffix).log_softmax(-1)
        hidden = model.capture_hidden(torch.tensor([seq[:j]]),
                                      anchor_positions(layout, j).unsqueeze(0))[:, 0]
        for k in ks:
            if k > hidden.shape[1]:
                continue
            states = replayed_states(model, hidden, k)
            got = continuation_logits(session, states, suffix).log_softmax(-1)
            acc[k]["kl"].append(float(F.kl_div(got, ref, log_target=True,
                                               reduction="batchmean")))
            acc[k]["top1"].append(float((got.argmax(-1) == ref.argmax(-1)).float().mean()))
            for g, ids in enumerate(groups):
                acc[k]["state_error"][g].append(relative_state_error(states, exact, ids))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {k: {"kl": mean(v["kl"]), "top1_agreement": mean(v["top1"]),
                "state_error_by_group": [mean(e) for e in v["state_error"]],
                "num_cuts": len(v["kl"])}
            for k, v in acc.items() if v["kl"]}


def choose_k_max(results: dict[int, dict], target: float) -> int:
    """The smallest k meeting the target; else the k with the best agreement (the
    smallest of equals)."""
    for k in sorted(results):
        if results[k]["top1_agreement"] >= target:
            return k
    return max(sorted(results), key=lambda k: results[k]["top1_agreement"])


def choose(by_density: dict[int, dict[int, dict]], target: float) -> tuple[int, int, bool]:
    """(anchors per page, k_max, target met) over sweeps at several densities: the fewest
    anchors per page with a k meeting the target, else the best agreement anywhere (the
    cheaper density of equals)."""
    for apc in sorted(by_density):
        k = choose_k_max(by_density[apc], target)
        if by_density[apc][k]["top1_agreement"] >= target:
            return apc, k, True
    best = max(sorted(by_density), key=lambda a: max(
        r["top1_agreement"] for r in by_density[a].values()))
    return best, choose_k_max(by_density[best], target), False


def plot(results: dict[int, dict], k_max: int, path: Path,
         by_density: dict[int, dict[int, dict]] | None = None) -> None:
    """State error per group (the chosen density) and top-1 agreement / KL against k (each
    density tried: one line each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    num_groups = len(results[ks[0]]["state_error_by_group"])
    for g in range(num_groups):
        a.plot(ks, [results[k]["state_error_by_group"][g] for k in ks], marker="o",
               label=f"group {g}")
    a.set(xscale="log", yscale="log", xlabel="replayed anchors k",
          ylabel="relative recurrent-state error", title="state error per group")
    a.legend()
    for apc, r in sorted((by_density or {None: results}).items(), key=lambda x: x[0] or 0):
        rk = sorted(r)
        b.plot(rk, [r[k]["top1_agreement"] for k in rk], marker="o",
               label="top-1 agreement" + (f", {apc} anchors/page" if apc else ""))
    b.legend(loc="lower right", fontsize=8)
    b.set(xscale="log", xlabel="replayed anchors k", ylabel="top-1 agreement",
          title=f"next-token agreement (k_max = {k_max})")
    b.axvline(k_max, color="gray", ls="--")
    b2 = b.twinx()
    b2.plot(ks, [results[k]["kl"] for k in ks], color="C3", marker="x", label="KL")
    b2.set(ylabel="KL(full || replay), nats", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--target", type=float, default=0.99, help="top-1 agreement to reach")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--anchors-per-page", type=int, nargs="+", default=[4],
                   help="one or more densities to try, cheapest first (default 4 of 64)")
    p.add_argument("--out", help="folder for calibration.json / .png (default: --model's)")
    args = p.parse_args(argv)
    if args.page_size < 1:
        p.error(f"--page-size must be >= 1, got {args.page_size}")
    if any(not 0 < a <= args.page_size for a in args.anchors_per_page):
        p.error(f"--anchors-per-page must lie in 1..{args.page_size}")
    if not args.target > 0 or args.target == float("inf"):  # (NaN fails this too; a target
        p.error(f"--target must be a number > 0, got {args.target}")  # above 1: unreachable)
    out_dir = Path(args.out or args.model)
    if out_dir.exists() and not out_dir.is_dir():
        p.error(f"--out {out_dir} is a file, not a folder")
    torch.set_num_threads(2)
    try:
        model = load_model(args.model)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        p.error(f"--model {args.model} is not usable: {e}")
    num, length = (4, 1152) if args.quick else (12, 2112)
    boundaries = [512, 1024] if args.quick else [512, 1024, 1536, 2048]
    seqs = calibration_sequences(num, length)
    by_density: dict[int, dict[int, dict]] = {}
    for apc in sorted(set(args.anchors_per_page)):
        by_density[apc] = sweep(model, seqs, boundaries, 64, AnchorLayout(args.page_size, apc))
        if choose(by_density, args.target)[2]:
            break  # denser anchors cost more storage and would not be chosen
    apc, k_max, met = choose(by_density, args.target)
    results = by_density[apc]
    out = {"k_max": k_max, "target_top1_agreement": args.target, "target_met": met,
           "top1_agreement": results[k_max]["top1_agreement"],
           "page_size": args.page_size, "anchors_per_page": apc,
           "sampling": "dense_tail", "sweep": {str(k): v for k, v in results.items()},
           "sweeps_by_anchors_per_page": {str(a): {str(k): v for k, v in r.items()}
                                          for a, r in by_density.items()}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(results, k_max, out_dir / "calibration.png", by_density)
    for a, r in by_density.items():
        for k, v in sorted(r.items()):
            print(f"{a:3d}/page k={k:4d}  top1={v['top1_agreement']:.4f}  KL={v['kl']:.2e}  "
                  "state err=" + ", ".join(f"{e:.3f}" for e in v["state_error_by_group"]))
    print(f"k_max = {k_max}, {apc} anchors per {args.page_size}-token page (target top-1 "
          f"agreement {args.target}); wrote {out_dir / 'calibration.json'}")
    if not met:
        print(f"warning: no k up to {max(results)} at {sorted(by_density)} anchors per page "
              f"reaches the target; the best is {results[k_max]['top1_agreement']:.4f} "
              f"(k = {k_max}, {apc} a page). Denser anchors (--anchors-per-page), a lower "
              "target or exact paths (live states, checkpoints) are the options.")
    return out


if __name__ == "__main__":
    main()
