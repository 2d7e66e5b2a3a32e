"""Trains the project's default model: a byte-level Qwen3.5-architecture hybrid on this CPU
(`--family nemotron_h`: the Nemotron-H-architecture one, Mamba2 + attention + MLP layers).

Deterministic (seeded), resumable (`--resume` continues from the last checkpoint in
`--work-dir`), with a tqdm bar and a loss-curve PNG. Data: the interpreter's standard library
(held-out files excluded) mixed with synthetic long-context tasks (engine_build/tasks.py).
Sequence length grows over training (512 -> 4096 bytes) at a constant number of tokens per
step, so the full-attention layers learn retrieval at the lengths the tasks are measured at.

    make model        # the default model's two-stage recipe (MODEL_CARD.md), ~46 minutes
    python -m engine_build.train_tiny --steps 5 --out /tmp/m   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from backend.config import FULL, LINEAR, NEMOTRON_H, NEMOTRON_H_CODES, ModelConfig
from backend.model import load_model
from backend.model.hybrid import HybridForCausalLM
from engine_build.corpus import EOT, MixedSampler, load_split, to_ids
from engine_build.evaluate import task_accuracy
from engine_build.hf_export import save_hf_directory

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "model_repo/hybrid_llm/1/tiny_qwen3_5"
# (fraction of training at which the phase starts, sequence length); tokens per step fixed.
PHASES = ((0.0, 512), (0.25, 1024), (0.7, 2048), (0.92, 4096))


FAMILIES = ("qwen3_5", NEMOTRON_H)


def tiny_config(hidden: int = 256, layers: int = 8, family: str = "qwen3_5") -> ModelConfig:
    """Qwen3.5: `layers` decoder layers, every fourth full attention. Nemotron-H: the same
    number of token mixers, each Mamba2 one followed by an MLP layer and each attention layer
    by one after it (8 -> "M-M-M*-M-M-M*-", 14 layers); Mamba2 with 8 heads of 32 (one times
    the hidden size, where Nemotron-H uses two), a 64-wide state in 2 groups."""
    if family == NEMOTRON_H:
        # As Nemotron-H's own: the Mamba2 layer before an attention layer has no MLP.
        pattern = "".join("*-" if (i + 1) % 4 == 0 else "M" if (i + 2) % 4 == 0 else "M-"
                          for i in range(layers))
        return ModelConfig(
            vocab_size=260, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=len(pattern), layer_types=tuple(NEMOTRON_H_CODES[c] for c in pattern),
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=hidden // 32,
            linear_key_head_dim=64, linear_value_head_dim=32, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-5, partial_rotary_factor=0.0, max_position_embeddings=32768,
            hidden_act="relu2", eos_token_id=EOT, model_type=NEMOTRON_H,
            extra={"use_conv_bias": True, "mamba_proj_bias": False, "mlp_bias": False,
                   "dt_min": 0.001},
        )
    if family != "qwen3_5":
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return ModelConfig(
        vocab_size=260, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        rope_theta=10_000.0, partial_rotary_factor=0.25, max_position_embeddings=32768,
        tie_word_embeddings=True, eos_token_id=EOT,
    )


def is_attention_qk_norm(name: str) -> bool:
    """The per-head q/k norm gains of a full-attention layer (not the linear layers' norms)."""
    return name.endswith(("q_norm.weight", "k_norm.weight")) and "self_attn" in name


def init_weights(model: HybridForCausalLM, seed: int, dt_init: str = "reference",
                 qk_gain: float = 1.0) -> None:
    """Small normal weights; norms at identity; Gated DeltaNet decay per `dt_init`.

    The decay per token is exp(-exp(A_log) * softplus(a + dt_bias)). "reference" keeps the
    constructor's values (dt_bias = 1, as transformers builds it; the committed default model
    was trained so): every head then starts forgetting within a few tokens. "log-uniform" draws
    dt = softplus(dt_bias) log-uniformly in [1e-3, 1e-1] as Mamba and flash-linear-attention
    do, so heads start with memories from a few tokens to thousands.

    `qk_gain` is the initial gain of the attention q/k norms (Qwen3.5 norms scale by 1 + w):
    the attention logits are bounded by qk_gain^2 * sqrt(head_dim), so a gain above 1 lets
    an attention head single out one position among thousands from the start.
    """
    if dt_init not in ("reference", "log-uniform"):
        raise ValueError(f"dt_init must be 'reference' or 'log-uniform', got {dt_init!r}")
    torch.manual_seed(seed)
    depth_scale = 1 / math.sqrt(2 * model.config.num_hidden_layers)
    for name, p in model.named_parameters():
        if ("dt_bias" in name or "A_log" in name) and dt_init == "reference":
            continue
        if "dt_bias" in name:
            with torch.no_grad():
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            continue
        if "A_log" in name:
            with torch.no_grad():
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            continue
        if is_attention_qk_norm(name):
            with torch.no_grad():
                p.fill_(qk_gain - 1.0)
            continue
        if name.endswith(("norm.weight", "mixer.D")):
            continue  # norms at identity, Mamba2's skip at its constructor's 1
        if name.endswith("conv1d.bias"):
            with torch.no_grad():
                p.zero_()
            continue
        if "conv1d" in name:
            torch.nn.init.normal_(p, std=0.3)
        elif p.dim() >= 2:
            std = 0.02 * (depth_scale if name.endswith(("out_proj.weight", "o_proj.weight",
                                                        "down_proj.weight")) else 1.0)
            torch.nn.init.normal_(p, std=std)


def param_groups(model: HybridForCausalLM, qk_norm_lr_mult: float = 1.0) -> list[dict]:
    """Weight decay on matrices only; norms, A_log and dt_bias are not pulled towards 0.

    The attention q/k norms bound the attention logits: with unit gains |q.k|/sqrt(d) <= sqrt(d)
    (8 for head dim 64), too flat to single out one key among a thousand positions. Decaying
    their (1 + w) gains towards 1 kept them there; they also get `qk_norm_lr_mult` x the LR.
    """
    groups: dict[str, list] = {"decay": [], "no_decay": [], "qk_norm": []}
    for name, p in model.named_parameters():
        if is_attention_qk_norm(name):
            groups["qk_norm"].append(p)
        elif p.dim() >= 2:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    return [{"params": groups["decay"], "lr_mult": 1.0},
            {"params": groups["no_decay"], "weight_decay": 0.0, "lr_mult": 1.0},
            {"params": groups["qk_norm"], "weight_decay": 0.0, "lr_mult": qk_norm_lr_mult}]


def seq_len_at(step: int, steps: int, phases=None) -> int:
    frac = step / max(steps, 1)
    return [n for start, n in (phases or PHASES) if frac >= start][-1]


def _range(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    lo, hi = (int(x) for x in text.split(":"))
    return lo, hi


def parse_phases(text: str | None):
    """"0:512,0.5:1024" -> ((0.0, 512), (0.5, 1024)); None -> PHASES."""
    if not text:
        return None
    return tuple((float(a), int(b)) for a, b in (part.split(":") for part in text.split(",")))


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def loss_fn(model: HybridForCausalLM, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids[:, :-1])
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                          reduction="none")
    w = weights.reshape(-1)
    return (nll * w).sum() / w.sum()


def train(args: argparse.Namespace) -> Path:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt_file = work / "checkpoint.pt"
    if args.init_from:
        model = load_model(args.init_from)  # a second stage continues from a saved model
        cfg = model.config
    else:
        cfg = tiny_config(args.hidden, args.layers, args.family)
        model = HybridForCausalLM(cfg)
        init_weights(model, args.seed, args.dt_init, args.qk_gain)
    opt = torch.optim.AdamW(param_groups(model, args.qk_norm_lr_mult), lr=args.lr,
                            betas=(0.9, 0.95), weight_decay=0.1)
    sampler = MixedSampler(to_ids(load_split(held_out=False, max_bytes=args.max_corpus_bytes)),
                           task_fraction=args.task_fraction, answer_weight=args.answer_weight,
                           seed=args.seed, extra_queries=args.extra_queries,
                           kinds=tuple(args.tasks.split(",")),
                           task_context=_range(args.task_context), text_weight=args.text_weight,
                           task_layout=args.task_layout)
    phases = parse_phases(args.phases)
    history: list[dict] = []
    step, elapsed = 0, 0.0
    if args.resume and ckpt_file.exists():
        state = torch.load(ckpt_file, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sampler.rng.setstate(state["sampler_rng"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="train", unit="step")
    t0 = time.time() - elapsed
    while step < args.steps:
        seq_len = seq_len_at(step, args.steps, phases)
        ids, weights = sampler.sample(max(args.batch_tokens // seq_len, 1), seq_len)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup) * group["lr_mult"]
        loss = loss_fn(model, ids, weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        history.append({"step": step, "loss": loss.item(), "seq_len": seq_len,
                        "time": time.time() - t0})
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            history[-1]["kv_accuracy"] = retrieval_probe(model, args.eval_context)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", len=seq_len,
                        kv=f"{last_probe(history):.2f}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "elapsed": time.time() - t0, "history": history,
                        "sampler_rng": sampler.rng.getstate(),
                        "torch_rng": torch.get_rng_state()}, ckpt_file)
        if args.max_minutes and time.time() - t0 > args.max_minutes * 60:
            tqdm.write(f"time cap of {args.max_minutes} min reached at step {step}")
            break
    bar.close()
    model.eval()
    out = save_hf_directory(model, args.out)
    summary = {"steps": step, "train_seconds": round(time.time() - t0, 1),
               "final_loss": history[-1]["loss"] if history else None,
               "tokens_seen": sum(args.batch_tokens // h["seq_len"] * h["seq_len"]
                                  for h in history),
               "config": {k: v for k, v in asdict(cfg).items() if k != "extra"},
               "args": vars(args)}
    (work / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (work / "loss_history.json").write_text(json.dumps(history))
    plot_loss(history, out / "loss_curve.png",
              "Nemotron-H" if cfg.is_nemotron_h else "Qwen3.5")
    return out


def retrieval_probe(model: HybridForCausalLM, context_len: int, n: int = 16) -> float:
    """Key-value retrieval accuracy at `context_len` bytes on n fixed examples (the
    evaluation's own examples, so the curve shows when retrieval appears in training)."""
    model.eval()
    try:
        return task_accuracy(model, "kv", context_len, n)
    finally:
        model.train()


def last_probe(history: list[dict]) -> float:
    return next((h["kv_accuracy"] for h in reversed(history) if "kv_accuracy" in h), 0.0)


def plot_loss(history: list[dict], path: Path, family: str = "Qwen3.5") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    steps = [h["step"] for h in history]
    losses = [h["loss"] / math.log(2) for h in history]
    k = max(len(losses) // 50, 1)
    smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1])
              for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, alpha=0.3, label="per step")
    ax.plot(steps, smooth, label=f"moving mean ({k + 1} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted training loss (bits per byte)")
    ax.set_title(f"tiny {family}-architecture model: training loss")
    ax.legend(loc="upper left")
    probes = [(h["step"], h["kv_accuracy"]) for h in history if "kv_accuracy" in h]
    if probes:
        ax2 = ax.twinx()
        ax2.plot(*zip(*probes), color="tab:green", marker=".", label="key-value accuracy")
        ax2.set_ylabel("key-value retrieval accuracy (probe)")
        ax2.set_ylim(0, 1)
        ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="HF-format output directory")
    p.add_argument("--work-dir", default="runs/tiny", help="checkpoint, history, summary")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="token mixers (see tiny_config)")
    p.add_argument("--family", choices=FAMILIES, default="qwen3_5",
                   help="architecture of a model trained from scratch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dt-init", choices=("reference", "log-uniform"), default="reference",
                   help="Gated DeltaNet decay initialisation (see init_weights)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--max-minutes", type=float, default=45.0)
    p.add_argument("--max-corpus-bytes", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", default=None, help="start from this HF directory's weights")
    p.add_argument("--task-fraction", type=float, default=0.5,
                   help="share of sequences that start with a synthetic task")
    p.add_argument("--answer-weight", type=float, default=4.0)
    p.add_argument("--tasks", default="kv,needle,vars",
                   help="synthetic task kinds to mix in (engine_build/tasks.py; 'copy' too)")
    p.add_argument("--task-context", default=None,
                   help='task contexts of "MIN:MAX" bytes (capped by the sequence length; '
                        'default: 30-95%% of the sequence)')
    p.add_argument("--text-weight", type=float, default=1.0,
                   help="loss weight of the non-answer bytes of tasks")
    p.add_argument("--extra-queries", type=int, default=0,
                   help="further key-value questions per task context (denser retrieval signal)")
    p.add_argument("--qk-gain", type=float, default=1.0,
                   help="initial gain of the attention q/k norms (see init_weights)")
    p.add_argument("--qk-norm-lr-mult", type=float, default=1.0,
                   help="learning-rate multiplier of the attention q/k norm gains")
    p.add_argument("--task-layout", choices=("single", "packed"), default="single",
                   help="task sequences: one example then library text, or examples packed")
    p.add_argument("--eval-every", type=int, default=100,
                   help="probe key-value retrieval accuracy every N steps (0: never)")
    p.add_argument("--eval-context", type=int, default=1024,
                   help="context bytes of the retrieval probe")
    p.add_argument("--phases", default=None,
                   help='sequence-length schedule, e.g. "0:512,0.5:1024" (default: 512..4096)')
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)  # (exit 2 with the usage, not a traceback mid-run)
    return args


TASK_KINDS = ("kv", "needle", "vars", "copy", "recall")


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (None: nothing): values that failed deep in a run,
    or ran it wrongly without a word (--steps 0 wrote an untrained model)."""
    finite = math.isfinite
    for name, ok, want in (
            ("steps", args.steps >= 1, ">= 1"), ("batch_tokens", args.batch_tokens >= 1, ">= 1"),
            ("lr", finite(args.lr) and args.lr > 0, "a number > 0"),
            ("warmup", args.warmup >= 0, ">= 0"), ("hidden", args.hidden >= 32, ">= 32"),
            ("layers", args.layers >= 1, ">= 1"), ("threads", args.threads >= 1, ">= 1"),
            ("checkpoint_every", args.checkpoint_every >= 1, ">= 1"),
            ("max_minutes", finite(args.max_minutes) and args.max_minutes > 0, "a number > 0"),
            ("max_corpus_bytes", args.max_corpus_bytes is None or args.max_corpus_bytes >= 1,
             ">= 1"),
            ("task_fraction", 0 <= args.task_fraction <= 1, "in [0, 1]"),
            ("answer_weight", finite(args.answer_weight) and args.answer_weight >= 0, ">= 0"),
            ("text_weight", finite(args.text_weight) and args.text_weight >= 0, ">= 0"),
            ("extra_queries", args.extra_queries >= 0, ">= 0"),
            ("qk_gain", finite(args.qk_gain) and args.qk_gain > 0, "a number > 0"),
            ("qk_norm_lr_mult", finite(args.qk_norm_lr_mult) and args.qk_norm_lr_mult >= 0,
             ">= 0"),
            ("eval_every", args.eval_every >= 0, ">= 0"),
            ("eval_context", args.eval_context >= 1, ">= 1")):
        if not ok:
            return f"--{name.replace('_', '-')} must be {want}, got {getattr(args, name)}"
    kinds = args.tasks.split(",")
    if not all(k in TASK_KINDS for k in kinds):
        return f"--tasks must be a comma-separated list of {', '.join(TASK_KINDS)}, got " \
               f"{args.tasks!r}"
    try:
        context = _range(args.task_context)
        phases = parse_phases(args.phases)
    except ValueError:
        return f'--task-context must be "MIN:MAX" and --phases "FRACTION:LENGTH,...", got ' \
               f"{args.task_context!r} and {args.phases!r}"
    if context is not None and not 1 <= context[0] <= context[1]:
        return f"--task-context must be MIN:MAX with 1 <= MIN <= MAX, got {args.task_context!r}"
    if phases is not None and not all(0 <= f <= 1 and n >= 2 for f, n in phases):
        return f"--phases holds FRACTION:LENGTH with FRACTION in [0, 1] and LENGTH >= 2, got " \
               f"{args.phases!r}"
    if not args.init_from:
        try:
            tiny_config(args.hidden, args.layers, args.family)
        except ValueError as e:
            return f"--hidden {args.hidden} / --layers {args.layers}: {e}"
    return None


if __name__ == "__main__":
    print(train(parse_args()))
