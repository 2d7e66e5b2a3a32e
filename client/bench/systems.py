"""The systems compared by the benchmark suite: one engine configuration each.

Every system runs the same engine code; only the cache configuration differs. Memory is
budgeted, not page-counted: each system gets the same device bytes for cached prefixes
(`device_budget_bytes`) and spends them on KV pages plus what its policy stores beside them
(checkpoint slots for the checkpoint baseline, anchor blocks for suffix replay), using the
byte accounting of `backend/cache/accounting.py` for the served model. Running requests get
pages beyond the budget (`Budget.run_pages`); `max_cached_pages` keeps what stays cached
once they finish within the budget.

| system | states at a hit | KV tiers |
| --- | --- | --- |
| nocache | - (every prompt is prefilled) | - |
| checkpoint | state checkpoints every 256 tokens and at prompt ends (DESIGN's baseline) | device |
| sglang | state checkpoints where SGLang keeps them (below) | device |
| suffixreplay | anchors + budgeted replay at any page boundary | device |
| pcr_dram | checkpoints | device + DRAM, plain LRU, no overlap, no prefetch |
| lmcache_like | checkpoints | device + DRAM + SSD, no prefetch, no look-ahead, no overlap |
| pcr_overlap | checkpoints | + layer-wise overlap |
| pcr_full | checkpoints | + queue-driven prefetch + look-ahead eviction (full PCR) |
| ours | anchors + replay (live states also below the device) | full PCR |

`sglang` is the checkpoint baseline's memory with SGLang's own placement (its mamba radix
cache with the extra buffer): one state per 8192-token prefill chunk, at the request's branch
point or the chunk's end, and every 256 decode tokens (run on the branching workloads and
the distance sweep).

In the checkpoint-based tiered systems the states tier with their pages (`state_tier.py`):
a KV page in DRAM or on SSD is usable only with a saved state at or below it, so DRAM and
SSD bytes are split between KV pages and checkpoint slots as the device bytes are. In ours a
DRAM slot holds a page's KV and its anchor block, so it has fewer slots for the same bytes,
and where its device budget spares live states, up to an eighth of its DRAM (and of its SSD
budget) keeps the live states that lose their device slot: a prompt whose match ends on such
a page loads its state instead of replaying.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backend.cache.config import CacheConfig
from backend.config import ModelConfig
from backend.engine import EngineConfig
from backend.replay.budget import ReplayConfig

SYSTEMS = ("nocache", "checkpoint", "suffixreplay", "pcr_dram", "lmcache_like", "pcr_overlap",
           "pcr_full", "ours")
# The checkpoint baseline with SGLang's own placement (the branching workloads and the sweep).
SGLANG = "sglang"
INTERVAL = 256
SGLANG_PREFILL_CHUNK = 8192  # SGLang's chunked prefill size on H100/H200-class GPUs


@dataclass(frozen=True)
class Budget:
    page_size: int = 64
    device_budget_bytes: int = 8 << 20
    host_pages: int = 256
    ssd_bytes: int = 1 << 30
    run_pages: int = 48  # pages for running requests, outside the cache budget
    # (`max_cached_pages` keeps idle cached pages within the budget)
    max_num_seqs: int = 4
    max_tokens_per_step: int = 512


LIVE_STATE_SLOTS = 16  # suffix replay's resident states, where the budget spares them


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype_bytes: int = 4) -> int:
    return page_size * len(cfg.attention_layer_ids) * 2 * cfg.num_key_value_heads * \
        cfg.head_dim * dtype_bytes


def bytes_per_checkpoint(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes
    return len(cfg.linear_layer_ids) * (rec + conv)


def bytes_per_anchor_block(cfg: ModelConfig, anchors_per_page: int, dtype_bytes: int = 4) -> int:
    return cfg.num_groups * anchors_per_page * cfg.hidden_size * dtype_bytes


def system_params(system: str, cfg: ModelConfig, budget: Budget, k_max: int,
                  ssd_dir: Path | None = None) -> dict[str, str]:
    """The system as hybrid_llm string parameters (config.pbtxt form)."""
    if system not in SYSTEMS + (SGLANG,):
        raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS + (SGLANG,)}")
    ps = budget.page_size
    density = ReplayConfig().anchor_density
    page = bytes_per_page(cfg, ps)
    anchors = CacheConfig(page_size=ps, anchor_density=density).anchors_per_page
    # The checkpoint baseline's unit of memory: one checkpoint per interval, plus the KV
    # pages it covers (device, DRAM and SSD bytes are all split this way).
    group, state = INTERVAL // ps, bytes_per_checkpoint(cfg)
    unit = group * page + state
    if system == "nocache":
        policy, pages, slots = "none", 0, 4
    elif system in ("suffixreplay", "ours"):
        policy = "suffixreplay"
        # Live-state snapshots (states resident at prompt ends: an optimisation, the anchors
        # rebuild any state) come out of the same device budget: up to 16, at most an eighth
        # of it (none under a budget too small to spare one).
        slots = min(LIVE_STATE_SLOTS, budget.device_budget_bytes // (8 * state))
        pages = (budget.device_budget_bytes - slots * state) // (
            page + bytes_per_anchor_block(cfg, anchors))
    else:
        policy = "checkpoint"
        # Whole units of 4 KV pages and a checkpoint (RAG's 2 MiB: 8 pages, 2 checkpoints;
        # a floor of 4 checkpoints on top of the pages took 2.64 MiB there); a budget under
        # one unit keeps one checkpoint and the pages that fit beside it.
        units = budget.device_budget_bytes // unit
        slots = max(units, 1)
        pages = units * group if units else \
            max(0, budget.device_budget_bytes - state) // page
    params = {
        "cache_policy": policy, "page_size": str(ps), "checkpoint_interval": str(INTERVAL),
        "num_kv_pages": str(pages + budget.run_pages), "num_checkpoint_slots": str(slots),
        # The budget binds: pages no running request holds stay within it.
        "max_cached_pages": str(pages) if policy != "none" else "",
        "anchor_density": str(density), "k_max": str(k_max),
        # PCR's look-ahead eviction (protecting the waiting requests' pages) is full PCR's
        # only: every other system evicts plain LRU, as the baselines it stands for
        "lookahead_window": "6" if system in ("pcr_full", "ours") else "0",
        "max_num_seqs": str(budget.max_num_seqs),
        "max_tokens_per_step": str(budget.max_tokens_per_step), "max_context_len": "32768",
    }
    if system == SGLANG:  # the checkpoint baseline's memory, SGLang's placement
        params.update({"checkpoint_placement": "sglang",
                       "checkpoint_prefill_chunk": str(SGLANG_PREFILL_CHUNK)})
    if system.startswith("pcr") or system in ("lmcache_like", "ours"):
        ssd = system != "pcr_dram" and ssd_dir is not None
        # The same DRAM bytes for every system: budget.host_pages KV pages' worth, shared
        # with what the policy keeps beside the pages.
        host_bytes = budget.host_pages * page
        if policy == "checkpoint":  # the same DRAM / SSD bytes, shared with the states
            units = host_bytes // unit
            host_pages = units * group
            params["host_checkpoint_slots"] = str(units)
            ssd_states = budget.ssd_bytes // unit if ssd else 0
            if ssd:
                params["ssd_checkpoint_slots"] = str(ssd_states)
        else:  # anchor blocks tier with their page; the live states that lose their device
            # slot (where the device budget spares any) spill below it, as the checkpoint
            # systems' states do: up to an eighth of DRAM and of the SSD budget, as on the
            # device
            spill = host_bytes // (8 * state) if slots else 0
            host_pages = (host_bytes - spill * state) // (
                page + bytes_per_anchor_block(cfg, anchors))
            ssd_states = budget.ssd_bytes // (8 * state) if spill and ssd else 0
            if spill:
                params["host_checkpoint_slots"] = str(spill)
                if ssd:
                    params["ssd_checkpoint_slots"] = str(ssd_states)
        params.update({
            # the SSD's state files are paid from its bytes too (the tiers set
            # ssd_checkpoint_slots files aside from ssd_bytes; the page chunks get the rest)
            "host_pages": str(host_pages), "ssd_bytes": str(budget.ssd_bytes),
            # O_DIRECT (probed): SSD-tier reads come from the disk, not the page cache.
            "enable_ssd": str(ssd).lower(), "o_direct": "true", "use_kvikio": "false",
            "enable_overlap": str(system in ("pcr_overlap", "pcr_full", "ours")).lower(),
            "enable_prefetch": str(system in ("pcr_full", "ours")).lower(),
            "enable_lookahead": str(system in ("pcr_full", "ours")).lower(),
        })
        if ssd:
            params["ssd_path"] = str(ssd_dir)
    return params


def engine_config(system: str, cfg: ModelConfig, budget: Budget, k_max: int,
                  ssd_dir: Path | None = None) -> EngineConfig:
    params = system_params(system, cfg, budget, k_max, ssd_dir)
    if "ssd_path" in params:
        params["model_fingerprint"] = "bench-in-process"
    return EngineConfig.from_params(params)
