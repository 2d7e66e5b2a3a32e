"""Replay quality on the default model: retrieval accuracy, held-out bits per byte and top-1
agreement with linear states rebuilt by suffix replay, against a full prefill.

Each prompt is cut at a page boundary; the KV before the cut is exact (as served from the
prefix store) and the linear states at the cut come from replaying k anchors. The checkpoint
baseline resumes from exact states, so its quality equals the full prefill by construction;
it pays in storage and in recomputation instead (see storage below and replay_cost.py).

    python -m client.bench.quality [--quick] [--model DIR]
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from backend.cache.accounting import AnchorFormat, layout_from_hf
from backend.model import load_model
from backend.replay.anchors import AnchorLayout
from backend.replay.reference import (
    anchor_positions,
    continuation_logits,
    exact_run,
    replayed_states,
)
from client.bench.common import model_parser, pyplot, save_figure, write_summary
from engine_build.corpus import load_split, to_ids
from engine_build.evaluate import task_examples
from engine_build.hf_export import hf_config
from engine_build.tasks import TASKS

RESULTS = Path(__file__).resolve().parent / "results" / "quality"
PAGE = 64
KS = (16, 32, 64, 128, 256)


def variants(k_cal: int, apc_cal: int = 4) -> dict[str, tuple[str, str, object, int]]:
    """name -> (sampling, anchor dtype, k or 'default', anchors per page): 4 a page (the
    serving default) but for the calibrated variant, at its calibration's density."""
    out = {f"k{k}": ("dense_tail", "model", k, 4) for k in KS}
    out["calibrated"] = ("dense_tail", "model", k_cal, apc_cal)
    out["default"] = ("dense_tail", "model", "default", 4)
    out["default_uniform"] = ("uniform", "model", "default", 4)
    out["default_int8"] = ("dense_tail", "int8", "default", 4)
    return out


def budget(k, boundary: int, k_max: int) -> int:
    return min(math.ceil(0.05 * boundary), k_max) if k == "default" else k


class Case:
    """One prompt cut at a page boundary, with everything the variants share."""

    def __init__(self, model, prompt: list[int], target: list[int],
                 densities: tuple[int, ...] = (4,)) -> None:
        self.target = target
        self.boundary = (len(prompt) - 1) // PAGE * PAGE
        self.suffix = prompt[self.boundary:] + target[:-1]
        self.session, self.exact = exact_run(model, prompt + target, self.boundary, PAGE)
        ids = torch.tensor([prompt[:self.boundary]])
        layouts = {("uniform", 4)} | {("dense_tail", a) for a in densities}
        self.hidden = {(s, a): model.capture_hidden(ids, anchor_positions(
            AnchorLayout(PAGE, a, s), self.boundary).unsqueeze(0))[:, 0]
            for s, a in layouts}
        self.full = continuation_logits(self.session, self.exact, self.suffix)

    def scores(self, logits: torch.Tensor) -> dict[str, float]:
        n = len(self.target)
        answer = logits[-n:].argmax(-1)
        nll = torch.nn.functional.cross_entropy(logits[-n:], torch.tensor(self.target),
                                                reduction="sum")
        return {"correct": float(bool((answer == torch.tensor(self.target)).all())),
                "nll": float(nll), "tokens": n,
                "top1": float((logits.argmax(-1) == self.full.argmax(-1)).float().mean())}


def run_cases(model, cases: list[Case], k_cal: int, k_max: int,
              apc_cal: int = 4) -> dict[str, dict]:
    results = {"full": [c.scores(c.full) for c in cases]}
    for name, (sampling, dtype, k, apc) in tqdm(variants(k_cal, apc_cal).items(),
                                                desc="variants"):
        rows = []
        for c in cases:
            hidden = c.hidden[sampling, apc]
            kk = min(budget(k, c.boundary, k_max), hidden.shape[1])
            states = replayed_states(model, hidden, kk, int8=dtype == "int8")
            rows.append(c.scores(continuation_logits(c.session, states, c.suffix)))
        results[name] = rows
    return results


def summarize(rows: list[dict]) -> dict[str, float]:
    n = len(rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"accuracy": sum(r["correct"] for r in rows) / n,
            "bits_per_byte": sum(r["nll"] for r in rows) / tokens / math.log(2),
            "top1_agreement": sum(r["top1"] for r in rows) / n}


def task_cases(model, contexts, n, densities=(4,)) -> list[Case]:
    cases = []
    for kind in TASKS:
        for ctx in contexts:
            for ex in task_examples(kind, ctx, n, seed=99):
                cases.append(Case(model, list(ex.prompt.encode()), list(ex.answer.encode()),
                                  densities))
    return cases


def text_cases(model, num: int, length: int, densities=(4,)) -> list[Case]:
    text = to_ids(load_split(held_out=True, max_bytes=num * length * 2))
    step = len(text) // num
    cases = []
    for i in range(num):
        seq = text[i * step:i * step + length].tolist()
        cut = length - 256
        cases.append(Case(model, seq[:cut + 1], seq[cut + 1:], densities))
    return cases


def main(argv: list[str] | None = None) -> dict:
    parser = model_parser(__doc__)
    parser.add_argument("--out", default="quality",
                        help="results folder under client/bench/results/")
    args = parser.parse_args(argv)
    results = RESULTS.parent / args.out
    torch.set_num_threads(2)
    model = load_model(args.model)
    cal_file = Path(args.model) / "calibration.json"
    calibration = json.loads(cal_file.read_text()) if cal_file.exists() else {}
    k_cal = calibration.get("k_max", 512)
    apc_cal = calibration.get("anchors_per_page", 4) * PAGE // calibration.get("page_size", PAGE)
    densities = tuple(sorted({4, apc_cal}))
    contexts, n, n_text = ((1024,), 6, 6) if args.quick else ((1024, 2048), 16, 16)
    t0 = time.time()
    cases = task_cases(model, contexts, n, densities)
    text = text_cases(model, n_text, 1024 + 256, densities)
    retrieval = {k: summarize(v) for k, v in
                 run_cases(model, cases, k_cal, k_cal, apc_cal).items()}
    heldout = {k: summarize(v) for k, v in run_cases(model, text, k_cal, k_cal, apc_cal).items()}
    args.calibrated_anchors_per_page = apc_cal
    args.cached_lens = [c.boundary for c in cases]
    summary = build_summary(model, retrieval, heldout, k_cal, contexts, n, args)
    summary["seconds"] = round(time.time() - t0, 1)
    write_summary(results / "summary.json", summary, echo=False)
    plot(summary, results / "quality_vs_k.png")
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}, indent=2))
    return summary


def workload_storage(cfg, cached_lens: list[int], interval: int = 256,
                     calibrated_apc: int = 4) -> dict:
    """Bytes each policy stores to make these cached prompts reusable: anchors for every page
    (suffix replay) against checkpoints every `interval` tokens plus one at each prompt end
    (the checkpoint baseline's own configuration)."""
    raw = hf_config(cfg)
    raw["torch_dtype"] = "float32"
    layout = layout_from_hf(raw, "default")
    elem = layout.model_dtype_bytes
    fmt = AnchorFormat("model", elem)
    int8 = AnchorFormat("int8+fp32 scale", 1, 4)
    pages = sum(n // PAGE for n in cached_lens)
    checkpoints = sum(n // interval + (n % interval > 0) for n in cached_lens)
    anchors = pages * layout.anchor_bytes_per_page(PAGE, 4 / PAGE, fmt)
    anchors8 = pages * layout.anchor_bytes_per_page(PAGE, 4 / PAGE, int8)
    anchors_cal = pages * layout.anchor_bytes_per_page(PAGE, calibrated_apc / PAGE, fmt)
    ckpt = checkpoints * layout.checkpoint_bytes()
    per_page_ckpt = pages * layout.checkpoint_bytes()
    return {"num_prompts": len(cached_lens), "cached_pages": pages,
            "checkpoints_at_interval": checkpoints, "interval": interval,
            "anchor_bytes": anchors, "anchor_bytes_int8": anchors8, "checkpoint_bytes": ckpt,
            "ratio_vs_checkpoint": anchors / ckpt, "ratio_vs_checkpoint_int8": anchors8 / ckpt,
            "ratio_vs_checkpoint_calibrated_density": anchors_cal / ckpt,
            "ratio_vs_checkpoint_every_page": anchors / per_page_ckpt}


def retention(variant: dict, full: dict) -> float:
    """Quality kept, in percent: accuracy ratio, or bits-per-byte ratio if accuracy is 0."""
    if full["accuracy"] > 0:
        return 100 * variant["accuracy"] / full["accuracy"]
    return 100 * full["bits_per_byte"] / variant["bits_per_byte"]


def build_summary(model, retrieval, heldout, k_cal, contexts, n, args) -> dict:
    full = retrieval["full"]
    storage = workload_storage(model.config, args.cached_lens,
                               calibrated_apc=args.calibrated_anchors_per_page)
    return {
        "model": str(args.model), "quick": args.quick, "contexts": list(contexts),
        "examples_per_task_and_context": n, "calibrated_k_max": k_cal,
        "calibrated_anchors_per_page": args.calibrated_anchors_per_page,
        "retention_default": retention(retrieval["default"], full),
        "retention_k16": retention(retrieval["k16"], full),
        "retention_calibrated": retention(retrieval["calibrated"], full),
        "retention_default_uniform": retention(retrieval["default_uniform"], full),
        "retention_default_int8": retention(retrieval["default_int8"], full),
        "heldout_bpb_full": heldout["full"]["bits_per_byte"],
        "heldout_bpb_default": heldout["default"]["bits_per_byte"],
        "heldout_top1_agreement_default": heldout["default"]["top1_agreement"],
        "storage_ratio_vs_checkpoint": storage["ratio_vs_checkpoint"],
        "storage_ratio_vs_checkpoint_int8": storage["ratio_vs_checkpoint_int8"],
        "storage_ratio_vs_checkpoint_calibrated": storage["ratio_vs_checkpoint_calibrated_density"],
        "storage": storage, "retrieval": retrieval, "heldout": heldout,
        "date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU (no GPU)",
    }


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()

    full = summary["retrieval"]["full"]
    ks = list(KS)
    acc = [retention(summary["retrieval"][f"k{k}"], full) for k in ks]
    top1 = [100 * summary["heldout"][f"k{k}"]["top1_agreement"] for k in ks]
    fig, ax = plt.subplots(figsize=(7, 4))
    what = ("retrieval accuracy retention (%)" if full["accuracy"] > 0 else
            "task bits-per-byte retention (%; task accuracy 0)")
    ax.plot(ks, acc, marker="o", label=what)
    ax.plot(ks, top1, marker="s", label="held-out top-1 agreement (%)")
    ax.axhline(100, color="gray", ls="--", label="full prefill / checkpoint baseline")
    ax.set(xscale="log", xlabel="replayed anchors k (dense tail, 4 per 64-token page)",
           ylabel="percent of full prefill",
           title=f"Suffix replay quality vs k ({Path(summary['model']).name})")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
