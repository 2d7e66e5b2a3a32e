"""`CompiledExecutor`: runs an AOT engine directory (`engine_build/build.py --backend aot`).

Same interface and buffers as `TorchExecutor`; the model's Python code is not used: the
prefill / decode step and each group's replay are AOTInductor packages, and the custom
operators they call come from `plugins` (imported here, as a TensorRT runtime loads its plugin
library). Step inputs are planned by the same `ForwardBatch` as the eager path, then packed.

Layer-wise tier transfers cannot interleave with a compiled graph's layers, so the hooks run
around the whole step: every layer's load is awaited before it, offloads start after it.

Engines whose prefill graph takes snapshots (`engine.json` "step_snapshots": CPU engines)
save one state per sequence in the middle of a step (`max_snapshots_per_row`); the scheduler
ends a step at any further state to keep, and everywhere on engines without them.

int8 anchors (`anchor_dtype: int8`): the graphs capture into a model-dtype staging buffer,
quantized into the int8 rows after the step; replay dequantizes before the replay graph.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backend.config import ModelConfig
from backend.engine.config import DTYPES
from backend.engine.executor import ExecutorBuffers
from backend.model.batch import SNAPSHOT_ALIGN, ForwardBatch, SeqInput
from backend.model.packed import packed_from_batch
from backend.model.quant import dequantize_int8, quantize_int8

# 2: engine.json names its checkpoint's signature (`checkpoint_signature`); 3: and each
# package's digest (`package_digest`)
ENGINE_FORMAT = 3
REBUILD = "rebuild it with engine_build/build.py --backend aot"


class EngineFormatError(ValueError):
    pass


def read_engine_meta(engine_dir: str | Path) -> dict:
    engine_dir = Path(engine_dir)
    meta_file = engine_dir / "engine.json"
    if not meta_file.exists():
        raise EngineFormatError(f"{meta_file}: missing (build one with engine_build/build.py "
                                "--backend aot; a build that stopped part way leaves none)")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise EngineFormatError(f"{meta_file}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise EngineFormatError(f"{meta_file}: not a JSON object")
    if meta.get("format") != ENGINE_FORMAT or meta.get("backend") != "aot":
        raise EngineFormatError(f"{meta_file}: format {meta.get('format')!r} / backend "
                                f"{meta.get('backend')!r}; this runtime reads format "
                                f"{ENGINE_FORMAT}, backend 'aot' ({REBUILD})")
    for name, kind, ok in (("num_groups", "an integer >= 1", lambda v: isinstance(v, int)
                            and not isinstance(v, bool) and v >= 1),
                           ("packages", "an object", lambda v: isinstance(v, dict)),
                           ("package_digests", "an object", lambda v: isinstance(v, dict)),
                           ("device", "a string", lambda v: isinstance(v, str)),
                           ("dtype", f"one of {sorted(DTYPES)}", lambda v: v in DTYPES),
                           ("source_signature", "a string", lambda v: isinstance(v, str))):
        if not ok(meta.get(name)):
            raise EngineFormatError(f"{meta_file}: {name} must be {kind}, got "
                                    f"{meta.get(name)!r:.60} ({REBUILD})")
    for name in package_names(meta["num_groups"]):
        if not (engine_dir / str(meta["packages"].get(name, f"{name}.pt2"))).exists():
            raise EngineFormatError(f"{engine_dir}: package {name!r} is missing")
        if not isinstance(meta["package_digests"].get(name), str):
            raise EngineFormatError(f"{meta_file}: package_digests holds no digest of "
                                    f"{name!r} ({REBUILD})")
    return meta


def package_names(num_groups: int) -> list[str]:
    """An engine's packages: its prefill and decode steps and a replay per layer group."""
    return ["prefill", "decode"] + [f"replay_{g}" for g in range(num_groups)]


def package_digest(path: str | Path) -> str:
    """xxh3-128 of a whole package file: the weights are frozen into its compiled library,
    so a flipped byte there loads and runs, with other logits (the zip's CRCs are not
    checked at load)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def load_package(engine_dir: Path, meta: dict, name: str):
    """Package `name` of the engine in `engine_dir`, checked against its digest in
    engine.json; EngineFormatError, naming the file, for one changed or unloadable."""
    path = engine_dir / str(meta["packages"].get(name, f"{name}.pt2"))
    if package_digest(path) != meta["package_digests"][name]:
        raise EngineFormatError(f"{path}: its bytes differ from those the build wrote "
                                f"(corrupt or replaced; {REBUILD})")
    try:
        return torch._inductor.aoti_load_package(str(path))
    except (RuntimeError, OSError, ValueError) as e:
        raise EngineFormatError(f"{path}: cannot be loaded ({e}; {REBUILD})") from e


def checkpoint_signature(model_dir: str | Path) -> str:
    """xxh3-128 over a checkpoint's config.json and, per safetensors file, its header (tensor
    names, dtypes, shapes, offsets), size and 64 KiB of weights at 256 places across it: an
    engine built from it says so, and a checkpoint changed since (another model, retrained
    or fine-tuned weights) has another signature. Reads at most 16 MiB a file."""
    import xxhash

    root = Path(model_dir)
    h = xxhash.xxh3_128()
    h.update((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            h.update(head)
            h.update(f.read(int.from_bytes(head, "little") if len(head) == 8 else 0))
            step = max(size // 256, 1)
            for offset in range(0, size, step):
                f.seek(offset)
                h.update(f.read(64 << 10))
    return h.hexdigest()


def check_engine_source(engine_dir: str | Path, model_dir: str | Path) -> None:
    """EngineFormatError unless the engine in `engine_dir` was built from the checkpoint in
    `model_dir` as it is now (the engine holds its own weights; the tokenizer, calibration
    and cache fingerprints come from `model_dir`)."""
    meta = read_engine_meta(engine_dir)
    if meta["source_signature"] != checkpoint_signature(model_dir):
        raise EngineFormatError(
            f"{engine_dir} was built from another checkpoint than {model_dir} (or the "
            f"checkpoint changed since: built from {meta.get('source_model')}); {REBUILD}")


class CompiledExecutor(ExecutorBuffers):
    def __init__(
        self,
        engine_dir: str | Path,
        num_kv_pages: int,
        page_size: int,
        num_run_slots: int,
        num_saved_slots: int,
        num_anchor_rows: int,
        int8_anchors: bool = False,
    ) -> None:
        import plugins  # noqa: F401  (the engines call torch.ops.suffixreplay.*)

        engine_dir = Path(engine_dir)
        meta = read_engine_meta(engine_dir)
        if meta["device"].startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"{engine_dir} was built for {meta['device']}; no CUDA here")
        cfg = ModelConfig.from_file(engine_dir / "config.json")
        self._setup(cfg, torch.device(meta["device"]), DTYPES[meta["dtype"]], num_kv_pages,
                    page_size, num_run_slots, num_saved_slots, num_anchor_rows, int8_anchors)
        self.meta = meta
        self._snapshots = bool(meta.get("step_snapshots", False))
        self.prefill = load_package(engine_dir, meta, "prefill")
        self.decode = load_package(engine_dir, meta, "decode")
        self.replays = [load_package(engine_dir, meta, f"replay_{g}")
                        for g in range(cfg.num_groups)]

    @classmethod
    def from_graphs(cls, model, num_kv_pages: int, page_size: int, num_run_slots: int,
                    num_saved_slots: int, num_anchor_rows: int, snapshots: bool = True,
                    int8_anchors: bool = False) -> CompiledExecutor:
        """The same executor over the uncompiled graphs (`backend.model.packed`), run eagerly:
        checks the packed formulation apart from compilation (`snapshots=False`: the prefill
        graph of CUDA engines, without mid-step states)."""
        from backend.model.packed import ReplayGraph, StepGraph

        self = cls.__new__(cls)
        self._setup(model.config, model.device, model.dtype, num_kv_pages, page_size,
                    num_run_slots, num_saved_slots, num_anchor_rows, int8_anchors)
        self.meta = {"backend": "eager-graphs"}
        self._snapshots = snapshots
        self.prefill = torch.inference_mode()(StepGraph(model, snapshots=snapshots).eval())
        self.decode = torch.inference_mode()(StepGraph(model, decode=True).eval())
        self.replays = [torch.inference_mode()(ReplayGraph(model, g).eval())
                        for g in range(model.config.num_groups)]
        return self

    def _setup(self, cfg, device, dtype, num_kv_pages, page_size, num_run_slots,
               num_saved_slots, num_anchor_rows, int8_anchors) -> None:
        self.device, self.dtype = device, dtype
        # One spare anchor row per group and one spare saved-state slot: the graphs always
        # capture and (with snapshots) always save (scratch where nothing is asked), so no
        # dimension is ever 0. The store hands out saved slots below `num_saved_slots` only.
        # int8 anchors: the graphs capture into staging rows instead (row i: the step's i-th
        # capture, row 0 the scratch row), quantized into the anchor rows after the step.
        self._allocate(cfg, dtype, device, num_kv_pages, page_size, num_run_slots,
                       num_saved_slots + 1, num_anchor_rows, int8_anchors,
                       spare_anchor_rows=0 if int8_anchors else 1)
        self._staging = (torch.zeros(cfg.num_groups, 8, cfg.hidden_size, dtype=dtype,
                                     device=device) if int8_anchors else None)
        self._scratch_row = num_anchor_rows
        self._scratch_slot = num_saved_slots

    @property
    def num_anchor_rows(self) -> int:
        return self.anchors.shape[1]

    @property
    def supports_snapshots(self) -> bool:
        return self._snapshots

    max_snapshots_per_row = 1  # the prefill graph saves one state per sequence

    def _snapshot_inputs(self, batch: ForwardBatch, snapshots) -> tuple:
        """The prefill graph's snapshot inputs: offsets [B] (0: none), slots [B] (scratch
        where none), then the saved-state pools."""
        B = batch.input_ids.shape[0]
        offsets = torch.zeros(B, dtype=torch.long)
        slots = torch.full((B,), self._scratch_slot, dtype=torch.long)
        for row, offset, slot in snapshots or ():
            if offsets[row]:
                raise ValueError("the compiled step graph saves one state per sequence a step")
            if not 0 < offset <= int(batch.lengths[row]) or offset % SNAPSHOT_ALIGN:
                raise ValueError(f"snapshot offsets must be multiples of {SNAPSHOT_ALIGN} "
                                 f"within the row's new tokens, got {offset}")
            offsets[row], slots[row] = offset, slot
        return (offsets.to(self.device), slots.to(self.device),
                tuple(self.saved_states.conv), tuple(self.saved_states.rec))

    def forward(
        self, seqs: list[SeqInput], capture_src: torch.Tensor | None = None,
        capture_dst: torch.Tensor | None = None, layer_hooks: object | None = None,
        snapshots: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """One batched step; returns last-token logits [B, V] (fp32). snapshots: (row,
        offset, saved slot) as `TorchExecutor.forward` takes them, at most one per row, on
        engines that take snapshots (`supports_snapshots`)."""
        if snapshots and not self._snapshots:
            raise ValueError("this engine's step graph cannot save states mid-step")
        batch = ForwardBatch.build(seqs, self.kv, self.run_states, device=self.device)
        x = packed_from_batch(batch, capture_src)
        captures = x["capture_src"].numel()
        if not captures:  # the graph captures one token anyway, into a scratch row
            x["capture_src"] = torch.zeros(1, dtype=torch.long, device=self.device)
        if self._staging is None:
            pool = self.anchor_storage
            dst = (capture_dst.to(self.device) if captures else
                   torch.full((1,), self._scratch_row, dtype=torch.long, device=self.device))
        else:
            if self._staging.shape[1] < captures:
                self._staging = self._staging.new_zeros(
                    self._staging.shape[0], 1 << (captures - 1).bit_length(),
                    self._staging.shape[2])
            pool, dst = self._staging, torch.arange(max(captures, 1), device=self.device)
        num_attn = len(self.kv.k)
        if layer_hooks is not None:
            for a in range(num_attn):
                layer_hooks.before_read(a)
        decode = batch.input_ids.shape[1] == 1
        if snapshots and decode:
            raise ValueError("a decode step takes no mid-step snapshots")
        runner = self.decode if decode else self.prefill
        extra = () if decode or not self._snapshots else self._snapshot_inputs(batch, snapshots)
        # AOTInductor graphs assume the strides they were exported with (contiguous): a
        # strided view would be read wrongly without an error.
        x = {k: v.contiguous() for k, v in x.items()}
        logits = runner(
            x["input_ids"], x["positions"], x["cu_seqlens"], x["state_slots"], x["fresh"],
            x["write_slots"], x["pad_index"], x["read_slots"], x["attn_mask"],
            x["capture_src"], dst.contiguous(), tuple(pool.unbind(0)),
            tuple(self.kv.k), tuple(self.kv.v), tuple(self.run_states.conv),
            tuple(self.run_states.rec), *extra)
        if self._staging is not None and captures:
            q, scale = quantize_int8(self._staging[:, :captures])
            rows = capture_dst.to(self.device)
            self.anchors.index_copy_(1, rows, q)
            self.anchor_scales.index_copy_(1, rows, scale)
        if layer_hooks is not None:
            for a in range(num_attn):
                layer_hooks.after_write(a)
        return logits

    def replay(self, slots: list[int], anchor_rows: list[torch.Tensor],
               adapters: list[int] | None = None) -> None:
        """Rebuilds linear states into run slots from anchor rows (one packed call per group;
        the base model's weights: `adapters`, if given, must all be 0)."""
        if adapters and any(adapters):
            raise ValueError("a compiled engine runs no LoRA adapter")
        lengths = torch.tensor([r.numel() for r in anchor_rows])
        cu = torch.zeros(len(slots) + 1, dtype=torch.long)
        cu[1:] = lengths.cumsum(0)
        index = torch.cat([r.long().cpu() for r in anchor_rows]).to(self.device)
        cu = cu.to(self.device)
        slot_ids = torch.tensor(slots, device=self.device)
        if index.numel() == 0:  # nothing to replay: zero states
            for slot in slots:
                self.reset_state(slot)
            return
        for g, layers in enumerate(self.config.group_state_layers):
            hidden = self.anchors[g].index_select(0, index)
            if self.anchor_scales is not None:
                hidden = dequantize_int8(hidden, self.anchor_scales[g].index_select(0, index),
                                         self.dtype)
            out = self.replays[g](hidden, cu)
            states = [(out[2 * i], out[2 * i + 1]) for i in range(len(layers))]
            self._write_replayed(slot_ids, layers, states)
