"""GPU micro-benchmarks of the papers' premise on a random Qwen3.5-4B-shaped model (no weights
needed for timing). Writes $OUT/premise.json. Run by tests/gpu/run.sh; never run so far.

- replay of 512 anchors per group against recomputing an 8K-token suffix;
- hit TTFT against miss TTFT at 4K / 8K / 16K-token prefixes (the engine, suffix replay);
- host-to-device copy bandwidth of pinned KV pages (what a DRAM-tier promotion moves);
- layer-wise load through the tier code (`LayerwiseLoad` on a side stream) against loading
  everything first, with a compute stand-in of 1.5x one layer's transfer per layer: the
  exposed transfer time in layers (PCR's overlap on real copies).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from backend.cache.accounting import CONFIG_DIR
from backend.config import ModelConfig
from backend.engine import Engine, EngineConfig, SamplingParams
from backend.model.hybrid import HybridForCausalLM


def timed(fn, repeats: int = 3, sync=None) -> float:
    """Best wall time of `fn` over `repeats` runs after a warm-up (`sync`: the device wait,
    CUDA by default)."""
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def main() -> dict:
    out = Path(os.environ.get("OUT", "/tmp/gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_file(CONFIG_DIR / "qwen3_5_4b.json")
    with torch.device("cuda"):
        model = HybridForCausalLM(cfg).to(torch.bfloat16).eval()
    for p in model.parameters():
        p.normal_(0, 0.02)
    res: dict = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    hidden = torch.randn(1, 512, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    replay = timed(lambda: [model.replay_group(g, hidden) for g in range(cfg.num_groups)])
    ids = torch.randint(0, cfg.vocab_size, (1, 8192), device="cuda")
    recompute = timed(lambda: model(ids), repeats=2)
    res["replay_512_anchors_all_groups_ms"] = replay * 1000
    res["recompute_8k_suffix_ms"] = recompute * 1000
    res["replay_over_recompute"] = replay / recompute
    engine = Engine(model, EngineConfig.from_params({
        "num_kv_pages": "1024", "max_tokens_per_step": "8192", "max_context_len": "32768",
        "dtype": "bfloat16", "k_max": "512"}))
    sampling = SamplingParams(max_tokens=1, top_k=1)
    for n in (4096, 8192, 16384):
        prompt = torch.randint(0, cfg.vocab_size, (n,)).tolist()
        t = time.perf_counter()
        engine.generate(prompt, sampling, cache_salt=f"p{n}")
        miss = time.perf_counter() - t
        t = time.perf_counter()
        hit = engine.generate(prompt + [1] * 16, sampling, cache_salt=f"p{n}")
        res[f"ttft_{n}"] = {"miss_ms": miss * 1000, "hit_ms": (time.perf_counter() - t) * 1000,
                            "cached_tokens": hit.cached_tokens}
    page = 64 * len(cfg.attention_layer_ids) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    host = torch.empty(256 * page, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    copy = timed(lambda: dev.copy_(host, non_blocking=True))
    res["h2d_GBps_256_pages"] = host.numel() / copy / 1e9
    res["layerwise_load"] = layerwise_overlap(cfg)
    (out / "premise.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def layerwise_overlap(cfg: ModelConfig, num_pages: int = 128, device: str = "cuda") -> dict:
    """Load `num_pages` Qwen3.5-4B-shaped KV pages from pinned DRAM while a stand-in for each
    attention layer's compute runs, layer-wise (the tier code) or all first (no overlap)."""
    from backend.cache.host_pool import HostPool
    from backend.cache.overlap import LayerwiseLoad, TransferThread
    from backend.cache.page_io import CopyStream, DeviceBuffers

    layers, ps = len(cfg.attention_layer_ids), 64
    shape = (num_pages * ps, cfg.num_key_value_heads, cfg.head_dim)
    k = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    v = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    buffers = DeviceBuffers(k, v, ps)
    host = HostPool(buffers.layout, num_pages)
    host.kv.fill_(1)
    items = [(i, i) for i in range(num_pages)]
    stream = CopyStream(buffers.device).stream
    worker = None if stream is not None else TransferThread("premise-load")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def load() -> LayerwiseLoad:
        return LayerwiseLoad(buffers, host, worker, items, stream).start()

    transfer = timed(lambda: load().wait_all(), 5, sync) / layers
    a = torch.randn(2048, 2048, dtype=torch.bfloat16, device=device)
    one = timed(lambda: a @ a, 5, sync)
    reps = max(1, round(1.5 * transfer / one))

    def compute_layer() -> None:
        for _ in range(reps):
            a @ a

    def sequential() -> None:
        load().wait_all()
        for _ in range(layers):
            compute_layer()

    def overlapped() -> None:
        lw = load()
        for layer in range(layers):
            lw.wait(layer)
            compute_layer()

    alone = timed(lambda: [compute_layer() for _ in range(layers)], 5, sync)
    seq, ovl = timed(sequential, 5, sync), timed(overlapped, 5, sync)
    if worker is not None:
        worker.close()
    return {"pages": num_pages, "layer_transfer_ms": transfer * 1e3,
            "layer_GBps": buffers.layout.layer_bytes * num_pages / transfer / 1e9,
            "compute_per_layer_ms": alone / layers * 1e3,
            "sequential_exposed_layers": (seq - alone) / transfer,
            "overlapped_exposed_layers": (ovl - alone) / transfer}


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
