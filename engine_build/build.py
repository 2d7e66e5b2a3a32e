"""Builds a Triton model repository that serves a hybrid checkpoint (Qwen3.5, Qwen3-Next or
Nemotron-H).

    python -m engine_build.build --model CKPT --repo OUT                    # eager (default)
    python -m engine_build.build --model CKPT --repo OUT --backend aot      # AOTInductor engine
    python -m engine_build.build --model CKPT --repo OUT --backend tensorrt # where TensorRT is

Every backend first validates the checkpoint (config, tensor names and shapes, a short forward
with finite logits, a tokenizer) and writes a complete repository: ensemble, preprocessing,
hybrid_llm, postprocessing and hybrid_llm_bls, with `model_path` and `tokenizer_dir` pointing
at the checkpoint.
- `--calibrate` runs engine_build/calibrate.py on the checkpoint (4 anchors a page, 16 where 4
  fall short of the target), writes calibration.json / .png into the repository
  (`hybrid_llm/1/`, named by `calibration_path`; the checkpoint is left as it is) and serves
  `k_max: auto` and `anchor_density: auto`.
- An existing, non-empty `--repo` is refused before any step runs unless `--force` is given
  (which replaces the five models the build writes and leaves other entries there).
- `--lora NAME=PATH` (repeatable) checks a PEFT LoRA adapter against the checkpoint and serves
  it as NAME beside the base model (`lora_adapters`; eager backend).
- `--backend aot` exports and compiles the prefill / decode step and each group's replay
  (engine_build/aot.py) into `<checkpoint>/<engine_dir>` and selects executor `compiled`
  (every family; mixture-of-experts layers route through the `moe_experts` operator).
- `--backend tensorrt` needs the `tensorrt` package (NVIDIA's index; unavailable in this
  project's environment): it registers the Triton kernels as TensorRT plugins with AOT PTX
  (plugins/tensorrt.py). Without TensorRT it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from backend.engine.config import DTYPES, adapter_entries
from backend.model import load_model, lora
from backend.model.loader import CheckpointError
from backend.triton.repo import MODEL_REPO, set_parameters

MODELS = ("ensemble", "preprocessing", "hybrid_llm", "postprocessing", "hybrid_llm_bls")
TENSORRT_MISSING = 2


class BuildError(RuntimeError):
    pass


def validate_checkpoint(model_dir: Path, dtype: torch.dtype = torch.float32,
                        adapters: dict[str, Path] | None = None) -> dict:
    """Loads the checkpoint and runs 8 tokens (and each LoRA adapter of `adapters` against
    it); returns a short description."""
    try:
        model = load_model(model_dir, dtype=dtype)
    except (CheckpointError, ValueError) as e:
        raise BuildError(f"checkpoint {model_dir} is not usable: {e}") from e
    for name, path in (adapters or {}).items():
        try:
            lora.load_adapter(name, path, model)
        except ValueError as e:
            raise BuildError(str(e)) from e
    cfg = model.config
    ids = torch.arange(8).remainder(cfg.vocab_size).unsqueeze(0)
    logits = model.logits(ids)
    if not torch.isfinite(logits).all():
        raise BuildError(f"checkpoint {model_dir}: a forward of 8 tokens gave non-finite logits")
    if not (model_dir / "tokenizer.json").is_file():
        raise BuildError(f"checkpoint {model_dir}: tokenizer.json is missing (the repository's "
                         "preprocessing and postprocessing models need it)")
    if cfg.eos_token_id is not None and not 0 <= cfg.eos_token_id < cfg.vocab_size:
        raise BuildError(f"checkpoint {model_dir}: eos_token_id {cfg.eos_token_id} is outside "
                         f"the vocabulary [0, {cfg.vocab_size})")
    try:  # what preprocessing / postprocessing will load, and ids the model can take
        from backend.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    except Exception as e:
        raise BuildError(f"checkpoint {model_dir}: its tokenizer does not load: {e}") from e
    if tokenizer.vocab_size > cfg.vocab_size:
        raise BuildError(f"checkpoint {model_dir}: the tokenizer has {tokenizer.vocab_size} "
                         f"tokens, more than the model's vocabulary of {cfg.vocab_size}")
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "layers": cfg.num_hidden_layers, "groups": cfg.num_groups,
            "model_type": cfg.model_type, "moe": cfg.has_moe}


def _within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies inside it (links resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def check_repository(repo: Path, force: bool) -> None:
    """Refuses an existing, non-empty `repo` without `force`, and one that cannot be a folder
    (a file there or above it), before any step runs."""
    if repo.exists() and not repo.is_dir():
        raise BuildError(f"{repo} exists and is not a folder")
    for parent in repo.resolve().parents:
        if parent.exists() and not parent.is_dir():
            raise BuildError(f"--repo {repo}: {parent} is a file, not a folder")
    if repo.exists() and any(repo.iterdir()) and not force:
        raise BuildError(f"{repo} exists and is not empty (use --force to replace it)")
    nearest = next(p for p in (repo.resolve(), *repo.resolve().parents) if p.exists())
    try:  # (a folder made and removed where the repository's first new folder goes)
        os.rmdir(tempfile.mkdtemp(prefix=".build-probe-", dir=nearest))
    except OSError as e:
        raise BuildError(f"--repo {repo}: cannot write in {nearest} ({e.strerror or e})") \
            from None


def write_repository(model_dir: Path, repo: Path, params: dict[str, str], force: bool,
                     calibration: Path | None = None) -> Path:
    """Copies the models' configurations and code; points them at `model_dir`; puts
    `calibration` (a folder holding calibration.json / .png) in as `hybrid_llm/1/`'s."""
    check_repository(repo, force)
    try:
        return _write_repository(model_dir, repo, params, calibration)
    except OSError as e:
        raise BuildError(f"--repo {repo}: writing the repository failed: {e}") from None


def _write_repository(model_dir: Path, repo: Path, params: dict[str, str],
                      calibration: Path | None) -> Path:
    if repo.exists() and any(repo.iterdir()):
        for name in MODELS:
            shutil.rmtree(repo / name, ignore_errors=True)
    repo.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        src, dst = MODEL_REPO / name, repo / name
        (dst / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "config.pbtxt", dst / "config.pbtxt")
        if (src / "1" / "model.py").exists():
            shutil.copy2(src / "1" / "model.py", dst / "1" / "model.py")
    if calibration is not None:
        for name in ("calibration.json", "calibration.png"):
            if (calibration / name).exists():
                shutil.copy2(calibration / name, repo / "hybrid_llm" / "1" / name)
        params = {**params, "calibration_path": "1/calibration.json"}
    model_dir = model_dir.resolve()
    for name in ("preprocessing", "postprocessing", "hybrid_llm_bls"):
        set_parameters(repo / name / "config.pbtxt", {"tokenizer_dir": str(model_dir)})
    set_parameters(repo / "hybrid_llm" / "config.pbtxt",
                   {"model_path": str(model_dir), **params})
    return repo


def build(args: argparse.Namespace) -> Path:
    model_dir, repo = Path(args.model), Path(args.repo)
    steps = ["validate", *(["calibrate"] if args.calibrate else []),
             *(["compile"] if args.backend != "eager" else []), "repository"]
    params: dict[str, str] = {"dtype": args.dtype}
    adapters = lora_options(args.lora)
    if args.device != "cpu" and args.backend != "aot":
        raise BuildError(f"--device applies to --backend aot only (got --device {args.device} "
                         f"with --backend {args.backend})")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise BuildError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise BuildError(f"--device {args.device}: CUDA is not available here (build on the "
                         "GPU machine that will serve the engine)")
    if adapters and args.backend != "eager":
        raise BuildError(f"--lora needs --backend eager (a {args.backend} engine holds the "
                         "base model's weights only)")
    if adapters:
        for name, path in adapters.items():
            if "," in str(path.resolve()):  # the parameter is a comma-separated list
                raise BuildError(f"--lora {name}: the adapter's path {path.resolve()} holds a "
                                 "comma, which the lora_adapters parameter cannot carry")
        params["lora_adapters"] = ",".join(f"{n}={p.resolve()}" for n, p in adapters.items())
    for what, path in (("--model", model_dir), *((f"--lora {n}", p) for n, p in adapters.items())):
        if any(ch in str(path.resolve()) for ch in '"\\\n'):
            raise BuildError(f"{what}: the path {str(path.resolve())!r} holds a quote, a "
                             "backslash or a newline, which config.pbtxt cannot carry as is")
    engine_dir = Path(args.engine_dir)
    if args.backend == "aot" and (engine_dir.is_absolute() or not engine_dir.parts
                                  or ".." in engine_dir.parts or engine_dir == Path(".")):
        raise BuildError(f"--engine-dir must be a folder inside the checkpoint (a relative "
                         f"path without '..'), got {args.engine_dir!r}")
    check_repository(repo, args.force)
    if model_dir.exists():  # (a missing checkpoint is validate's error)
        inside = _within(model_dir, repo) or _within(repo, model_dir)
        if inside:
            raise BuildError(f"the checkpoint {model_dir} and the repository {repo} overlap "
                             "(writing the repository would replace files of the checkpoint): "
                             "give --repo a folder of its own")
    calibration = None  # the folder --calibrate wrote into (the checkpoint stays as it is)
    bar = tqdm(steps, desc=f"build ({args.backend})", unit="step")
    for step in bar:
        bar.set_postfix(step=step)
        if step == "validate":
            info = validate_checkpoint(model_dir, DTYPES[args.dtype], adapters=adapters)
            tqdm.write(f"checkpoint ok ({info['model_type']}): {info['parameters']:,} "
                       f"parameters, {info['layers']} layers, {info['groups']} "
                       "linear-attention groups"
                       + (f"; LoRA adapters {', '.join(adapters)} ok" if adapters else ""))
        elif step == "calibrate":
            from engine_build import calibrate

            # Gated DeltaNet models meet the target at 4 anchors a page; long-memory Mamba2
            # models may need 16 (tried only when 4 falls short).
            calibration = Path(tempfile.mkdtemp(prefix="calibration-"))
            try:
                calibrate.main(["--model", str(model_dir), "--quick", "--out",
                                str(calibration), "--anchors-per-page", "4", "16"])
            except (Exception, SystemExit) as e:  # (calibrate's argument errors exit)
                shutil.rmtree(calibration, ignore_errors=True)
                raise BuildError(f"calibration of {model_dir} failed: {e!r}") from e
            params.update(k_max="auto", anchor_density="auto")
        elif step == "compile" and args.backend == "aot":
            from engine_build.aot import build_aot_engine

            build_aot_engine(model_dir, model_dir / args.engine_dir, device=args.device,
                             dtype=args.dtype, progress=True)
            params.update(executor="compiled", engine_dir=args.engine_dir)
        elif step == "compile" and args.backend == "tensorrt":
            from plugins.tensorrt import build_tensorrt_engine

            build_tensorrt_engine(model_dir, model_dir / "tensorrt", dtype=args.dtype)
        elif step == "repository":
            if calibration is None and (model_dir / "calibration.json").exists():
                # k_max: auto (the template's) reads it: serve the density it was measured at
                params.setdefault("anchor_density", "auto")
            try:
                write_repository(model_dir, repo, params, args.force, calibration)
            finally:
                if calibration is not None:
                    shutil.rmtree(calibration, ignore_errors=True)
    return repo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face-format checkpoint directory")
    p.add_argument("--repo", required=True, help="model repository to write")
    p.add_argument("--backend", choices=("eager", "aot", "tensorrt"), default="eager")
    p.add_argument("--device", default="cpu", help="aot: cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--engine-dir", default="aot", help="aot: engine folder inside --model")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate k_max and the anchor density, and serve 'auto'")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve this PEFT LoRA adapter as NAME beside the base model (checked "
                        "against the checkpoint; eager backend); repeatable")
    p.add_argument("--force", action="store_true",
                   help="replace the models this build writes in an existing repository "
                        "(other entries there stay)")
    return p.parse_args(argv)


def lora_options(values: list[str]) -> dict[str, Path]:
    """--lora NAME=PATH values -> {name: path} (BuildError naming a malformed one)."""
    try:
        return {name: Path(path) for name, path in adapter_entries(values, "--lora")}
    except ValueError as e:
        raise BuildError(str(e)) from e


def tensorrt_refusal(model_dir: Path) -> str | None:
    """Why `--backend tensorrt` cannot build this checkpoint (from its config.json), if so:
    its plugins are Qwen3.5's operators, with no expert routing."""
    from backend.config import ModelConfig

    try:
        cfg = ModelConfig.from_file(model_dir / "config.json")
    except (OSError, ValueError) as e:  # from_file's errors (a bad value: ValueError)
        return f"checkpoint {model_dir} is not usable: {e}"
    if cfg.is_nemotron_h:
        return ("--backend tensorrt registers Qwen3.5's operators only; build Nemotron-H "
                "checkpoints with --backend aot or eager")
    if cfg.has_moe:
        return ("--backend tensorrt has no plugin for mixture-of-experts layers; build this "
                "checkpoint with --backend aot or eager")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "tensorrt":
        from plugins.tensorrt import tensorrt_available

        refusal = tensorrt_refusal(Path(args.model))
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
            return 1

        ok, why = tensorrt_available()
        if not ok:
            print(f"error: --backend tensorrt needs TensorRT, which is not available here: {why}. "
                  "Install the `tensorrt` extra from NVIDIA's package index, or use "
                  "--backend aot (AOTInductor engines with the same kernels).", file=sys.stderr)
            return TENSORRT_MISSING
    try:
        repo = build(args)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {repo}: serve it with  make serve MODEL_REPO={repo}  (or, where Triton is "
          f"installed,  tritonserver --model-repository {repo})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
