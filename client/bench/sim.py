"""Trace-driven simulator: hit rates, TTFT and throughput of each system at any model size.

The cache is simulated at page granularity on the workload's real token ids: a prompt hits the
longest cached page-aligned prefix; the checkpoint baseline can only resume at a boundary that
holds a checkpoint (every `interval` tokens and at prompt ends); suffix replay at any page
boundary, paying the replay of k = min(ceil(f n), k_max) anchors per group, or none where it
keeps a live state (prompt ends, outputs' last page boundaries, replayed states; LRU over its
slots, the states a request resumed from going first once it saved a deeper one, as
`PrefixStore.shadow_states`) at the match end or, when recomputing the pages between is
cheaper, a few pages short of it; no cache never hits.
Capacity is a byte budget (KV plus checkpoints or anchors, from the model's shapes), evicted
least-recently-used, a prefix's deepest pages first (a request touches its pages from the
deepest to the first, so a chain's first page is its newest: the engine evicts leaves, never a
page another cached page extends); a DRAM tier behind the device holds what it evicts when the
system has one, and an SSD tier behind DRAM what DRAM evicts. (In the tiers checkpoints ride
with their pages, as `state_tier.py` keeps them: a hit's resume checkpoint loads from its
page's tier; suffix replay's live states that lose their slot spill to DRAM / SSD state slots
where the system has them, and a hit whose match ends on one loads it instead of replaying.)

TTFT of a request = overhead + prefill of the recomputed tokens (linear in tokens and in
tokens x context for attention) + replay of the anchors + loading tier-resident KV (and the
resume checkpoint) at the tier's bandwidth. PCR's mechanisms: with layer-wise overlap the load
hides behind the compute (max of the two, not their sum); open-loop requests (arrival times)
queue for one server (FCFS, busy for each request's prefill), and with prefetch a queued
request's SSD pages are read while it waits. Look-ahead eviction is not modelled.
`CostModel.fit` calibrates the coefficients by least squares on the measured records of a run
on this machine; `CostModel.h200` states the published-figure assumptions for a GPU
projection.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from backend.cache.eviction import SHARED_STATE_USES
from backend.replay.budget import ReplayConfig, recompute_is_cheaper, replay_budget
from client.bench.workloads import Workload


@dataclass
class CostModel:
    overhead_s: float
    per_token_s: float
    per_token_ctx_s: float  # x recomputed tokens x context tokens (attention)
    per_anchor_s: float
    per_output_token_s: float
    dram_bytes_per_s: float = 20e9
    ssd_bytes_per_s: float = 2e9
    name: str = "fitted"

    @classmethod
    def fit(cls, rows: list[dict]) -> CostModel:
        """rows: recomputed, context, anchors (anchor-group replays: the engine's k times its
        groups, `simulate`'s unit), ttft (s), output_tokens, e2el (s)."""
        if not rows:
            raise ValueError("CostModel.fit needs at least one measured request")
        a = np.array([[1.0, r["recomputed"], r["recomputed"] * r["context"], r["anchors"]]
                      for r in rows])
        y = np.array([r["ttft"] for r in rows])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        coef = np.maximum(coef, 0.0)
        decode = [(r["e2el"] - r["ttft"]) / max(r["output_tokens"] - 1, 1) for r in rows
                  if r["output_tokens"] > 1]
        return cls(*map(float, coef), float(np.median(decode)) if decode else 0.0)

    @classmethod
    def h200(cls, params_b: float, attn_layers: int, q_heads: int, head_dim: int,
             group_fraction: float) -> CostModel:
        """Assumptions (stated, not measured): H200 989 TFLOP/s dense bf16 at 40% utilisation
        for prefill, 4.8 TB/s HBM for decode (weights read once per step), PCIe Gen5 x16
        about 50 GB/s host-to-device, an NVMe RAID read of 12 GB/s; 2 x params FLOPs per
        token plus 4 x layers x query heads x head_dim per token-pair for attention (QK and PV,
        a multiply-add each); replaying one
        anchor through one group costs that group's share of the layers (`group_fraction`)."""
        flops = 989e12 * 0.4
        per_token = 2 * params_b * 1e9 / flops
        per_pair = 4 * attn_layers * q_heads * head_dim / flops
        per_anchor = per_token * group_fraction
        decode = 2 * params_b * 1e9 / 4.8e12
        return cls(0.004, per_token, per_pair, per_anchor, decode, 50e9, 12e9, "h200-assumed")

    def compute_s(self, recomputed: int, context: int, anchors: int) -> float:
        """A hit's time on the server without tier reads (`simulate` adds those)."""
        return (self.overhead_s + self.per_token_s * recomputed
                + self.per_token_ctx_s * recomputed * context + self.per_anchor_s * anchors)


@dataclass
class SimSystem:
    policy: str  # "none" | "checkpoint" | "suffixreplay"
    device_bytes: int
    dram_bytes: int = 0
    interval: int = 256
    checkpoint_slots: int | None = None  # a separate pool of state slots (None: in bytes)
    ssd_bytes: int = 0
    overlap: bool = False  # layer-wise: tier loads hide behind the step's compute
    prefetch: bool = False  # a queued request's SSD pages are read while it waits
    live_slots: int = 0  # suffix replay: live states kept (LRU) at prompt ends and replays
    # Suffix replay with state tiers: the live states that lose their device slot, kept in
    # DRAM (LRU) and then on SSD, loaded by a hit whose match ends on their page.
    live_dram_slots: int = 0
    live_ssd_slots: int = 0
    shadow_states: bool = True  # the engine's `shadowed_states_first`
    # The engine's replay-or-recompute rule (`ReplayConfig`) for a measured system's twin;
    # None: decided by the cost model (projections).
    replay: ReplayConfig | None = None


@dataclass
class Shapes:
    """Bytes per page of KV, per checkpoint, per page of anchors; replay budget."""

    page_size: int
    kv_page: int
    checkpoint: int
    anchor_page: int
    anchors_per_page: int
    groups: int
    budget_fraction: float = 0.05
    k_max: int = 512


def page_keys(tokens: list[int], page: int, salt: str = "") -> list[int]:
    """One key per whole page, chained over the prefix, in the request's cache namespace."""
    keys, h = [], hash(salt)
    for i in range(len(tokens) // page):
        h = hash((h, tuple(tokens[i * page:(i + 1) * page])))
        keys.append(h)
    return keys


class _Tier:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.used, self.items = capacity, 0, OrderedDict()

    def get(self, key) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        return False

    def put(self, key, size: int) -> list:
        if key in self.items:
            self.items.move_to_end(key)
            return []
        evicted = []
        while self.used + size > self.capacity and self.items:
            k, s = self.items.popitem(last=False)
            self.used -= s
            evicted.append((k, s))
        if size <= self.capacity:
            self.items[key] = size
            self.used += size
        return evicted


class _LiveStates(_Tier):
    """Suffix replay's live-state slots: LRU, except that shadowed states (`shadow`) go
    before the others, LRU among themselves, until a second request resumes from them
    (`resumed`), as the engine's `Evictor.shadow_states` / `resumed_from`."""

    def __init__(self, capacity: int, dram: int = 0, ssd: int = 0) -> None:
        super().__init__(capacity)
        self.cold: OrderedDict = OrderedDict()
        self.uses: dict = {}
        # Where evicted states spill (slots): DRAM, then SSD (staged through DRAM, as in
        # `state_tier.py`: nothing reaches SSD without DRAM slots).
        self.below = {"dram": _Tier(dram), "ssd": _Tier(ssd)}

    def lower(self, key) -> str | None:
        """The lower tier holding `key`'s state ("dram" / "ssd"), touched; None: none."""
        return next((name for name, tier in self.below.items() if tier.get(key)), None)

    def __contains__(self, key) -> bool:
        return key in self.items or key in self.cold

    def get(self, key) -> bool:
        if key in self.cold:
            self.cold.move_to_end(key)
            return True
        return super().get(key)

    def put(self, key, size: int = 1) -> list:
        """As `_Tier.put`, the shadowed states evicted first."""
        if key in self.cold:
            self.cold.move_to_end(key)
            return []
        evicted = []
        while self.cold and key not in self.items and self.used + size > self.capacity:
            k, s = self.cold.popitem(last=False)
            self.used -= s
            evicted.append((k, s))
        evicted += super().put(key, size)
        for k, _ in evicted:
            self.uses.pop(k, None)
        spilled = evicted
        for tier in self.below.values():  # down the state tiers; off the last: gone
            spilled = [e for k, s in spilled for e in tier.put(k, s)]
        if key in self.items:
            self.uses.setdefault(key, 0)
        return evicted

    def resumed(self, key) -> None:
        self.uses[key] = self.uses.get(key, 0) + 1
        if self.uses[key] >= SHARED_STATE_USES and key in self.cold:
            self.items[key] = self.cold.pop(key)

    def shadow(self, keys) -> None:
        for key in keys:
            if key in self.items and self.uses.get(key, 0) < SHARED_STATE_USES:
                self.cold[key] = self.items.pop(key)


def simulate(workload: Workload, system: SimSystem, shapes: Shapes, cost: CostModel) -> dict:
    if not workload.requests:
        raise ValueError(f"workload {workload.name!r} has no requests to simulate")
    ps = shapes.page_size
    device, dram = _Tier(system.device_bytes), _Tier(system.dram_bytes)
    ssd = _Tier(system.ssd_bytes)
    tiered = bool(system.dram_bytes or system.ssd_bytes)
    slots = system.checkpoint_slots
    checkpoints = _Tier(slots if slots is not None else 1 << 62)
    kept: set = set()  # tiered checkpoint systems: the pages with a checkpoint (any tier)
    replays = system.policy == "suffixreplay"
    live = _LiveStates(system.live_slots if replays else 0, system.live_dram_slots,
                       system.live_ssd_slots)
    page_bytes = shapes.kv_page + (shapes.anchor_page if system.policy == "suffixreplay" else 0)
    rows = []
    free_at = 0.0  # open loop: when the server finishes the prefill it is on
    for req in workload.requests:
        keys = page_keys(req.prompt, ps, req.salt)
        tiers: list[str] = []  # where each hit page is
        if system.policy != "none":
            for key in keys[: (len(req.prompt) - 1) // ps]:  # the last token is always computed
                where = "device" if key in device.items else "dram" if key in dram.items else \
                    "ssd" if key in ssd.items else None
                if where is None:
                    break
                tiers.append(where)
            by_name = {"device": device, "dram": dram, "ssd": ssd}
            for key, where in reversed(list(zip(keys, tiers))):  # touched leaf first
                by_name[where].get(key)
            if system.policy == "checkpoint":
                while tiers and not (keys[len(tiers) - 1] in kept if tiered
                                     else checkpoints.get(keys[len(tiers) - 1])):
                    tiers.pop()
        anchors, state_from = 0, None
        if system.policy == "suffixreplay" and tiers:
            end = keys[len(tiers) - 1]
            # A live state a lower tier kept at the match's end is loaded, not replayed.
            if end in live or (state_from := live.lower(end)) is None:
                del tiers[_resume_point(keys, len(tiers), live, shapes, cost,
                                        len(req.prompt), system.replay):]
                hit_pages = len(tiers)
                if live.get(keys[hit_pages - 1]):
                    live.resumed(keys[hit_pages - 1])
                else:
                    anchors = _replay_k(shapes, hit_pages) * shapes.groups
                    live.put(keys[hit_pages - 1], 1)  # the replayed state is kept
        hit_pages = len(tiers)
        cached = hit_pages * ps
        recomputed = len(req.prompt) - cached
        compute = cost.compute_s(recomputed, len(req.prompt), anchors)
        read = {t: tiers.count(t) * shapes.kv_page for t in ("dram", "ssd")}
        if system.policy == "checkpoint" and tiers and tiers[-1] in read:
            read[tiers[-1]] += shapes.checkpoint  # the resume state, from its page's tier
        if state_from is not None:
            read[state_from] += shapes.checkpoint  # suffix replay's live state, from below
        dram_load = read["dram"] / cost.dram_bytes_per_s
        ssd_load = read["ssd"] / cost.ssd_bytes_per_s
        wait = 0.0
        if req.arrival is not None:
            start = max(req.arrival, free_at)
            wait = start - req.arrival
        if system.prefetch:
            ssd_load = max(0.0, ssd_load - wait)
        load = dram_load + ssd_load
        service = max(compute, load) if system.overlap else compute + load
        if req.arrival is not None:
            free_at = start + service
        ttft = wait + service
        e2el = ttft + cost.per_output_token_s * max(req.max_tokens - 1, 0)
        rows.append({"tag": req.tag, "cached": cached, "ttft": ttft, "e2el": e2el,
                     "prompt": len(req.prompt)})
        if system.policy == "none":
            continue
        if keys:
            live.put(keys[-1], 1)  # the state at the prompt's last page boundary
            if (len(req.prompt) + req.max_tokens - 1) // ps > len(keys):
                # The decode's state at the output's last page boundary joins too, with a
                # slot of its own; the workloads' next prompts never match it (they carry
                # their own answers, not the model's), but it takes part in the LRU.
                live.put(("decode", keys[-1]), 1)
            if system.shadow_states and len(keys) > len(tiers):  # past the resume point
                live.shadow(keys[: len(tiers)])
        # Insert every full page of the prompt, the deepest first (leaves go first).
        for i, key in reversed(list(enumerate(keys))):
            for k, _size in device.put(key, page_bytes):
                if isinstance(k, tuple):  # a checkpoint held in the byte budget
                    checkpoints.items.pop(k[1], None)
                    continue
                spilled = [k]  # down the tiers the system has; what falls off the last is gone
                for tier in (t for t in (dram, ssd) if t.capacity):
                    spilled = [e for s in spilled for e, _ in tier.put(s, shapes.kv_page)]
                # (a lower tier's copy of a page promoted since is not the page's last)
                kept.difference_update(e for e in spilled if e not in device.items
                                       and e not in dram.items)
            end = (i + 1) * ps
            # The engine saves states past its resume point only (`checkpoint_positions`
            # from the cached length); the one it resumed from was touched by the lookup.
            if system.policy == "checkpoint" and end > cached and \
                    (end % system.interval == 0 or i == len(keys) - 1):
                if tiered:
                    kept.add(key)
                elif slots is not None:
                    checkpoints.put(key, 1)
                elif key not in checkpoints.items:
                    checkpoints.put(key, 0)
                    device.put(("ckpt", key), shapes.checkpoint)
    total = sum(r["prompt"] for r in rows)
    if all(req.arrival is not None for req in workload.requests):  # open loop: over the span
        span = max(req.arrival + r["e2el"] for req, r in zip(workload.requests, rows)) - \
            min(req.arrival for req in workload.requests)
    else:  # closed loop: one request after another
        span = sum(r["e2el"] for r in rows)
    return {"hit_rate": sum(r["cached"] for r in rows) / max(total, 1),
            "ttft_mean_s": float(np.mean([r["ttft"] for r in rows])),
            "ttft_by_tag_s": {t: float(np.mean([r["ttft"] for r in rows if r["tag"] == t]))
                              for t in dict.fromkeys(r["tag"] for r in rows)},
            "throughput_requests_per_s": len(rows) / max(span, 1e-9)}


def _resume_point(keys: list, hit_pages: int, live: _Tier, shapes: Shapes, cost: CostModel,
                  context: int, replay=None) -> int:
    """Pages a suffix-replay hit of `hit_pages` pages resumes after: all of them (a live state
    at the end, or a replay there), or fewer when a live state short of the end makes
    recomputing the pages between cheaper than the replay (the engine's
    `recompute_is_cheaper` with `replay`'s constants, or by the simulator's cost model)."""
    if keys[hit_pages - 1] in live:
        return hit_pages
    for j in range(hit_pages - 1, 0, -1):
        if keys[j - 1] in live:
            k = _replay_k(shapes, hit_pages)
            extra = (hit_pages - j) * shapes.page_size
            if replay is not None:
                cheaper = recompute_is_cheaper(extra, hit_pages * shapes.page_size, k, replay)
            else:
                cheaper = cost.per_token_s * extra + cost.per_token_ctx_s * extra * context \
                    <= cost.per_anchor_s * k * shapes.groups
            if cheaper:
                live.get(keys[j - 1])
                return j
            break  # a shallower state is farther still
    return hit_pages


def _replay_k(shapes: Shapes, hit_pages: int) -> int:
    """Anchors (per group) a hit of `hit_pages` pages replays: the engine's `replay_budget`."""
    config = ReplayConfig(budget_fraction=shapes.budget_fraction, k_max=shapes.k_max)
    return replay_budget(hit_pages * shapes.page_size, config,
                         hit_pages * shapes.anchors_per_page)


def system_of(config, shapes: Shapes) -> SimSystem:
    """The simulated twin of an EngineConfig: the device pages its cache may keep
    (`max_cached_pages`, else the whole pool), its checkpoint slots, its DRAM tier."""
    cache, tiers = config.cache, config.tiers
    page = shapes.kv_page + (shapes.anchor_page if cache.policy == "suffixreplay" else 0)
    dram = tiers.host_pages * shapes.kv_page if tiers is not None else 0
    ssd = tiers.ssd_bytes if tiers is not None and tiers.uses_ssd else 0
    if ssd and tiers.host_checkpoint_slots and cache.policy in ("checkpoint", "suffixreplay"):
        ssd = max(0, ssd - tiers.ssd_checkpoint_slots * shapes.checkpoint)  # the state files'
    pages = cache.num_kv_pages if cache.max_cached_pages is None else cache.max_cached_pages
    live = cache.num_checkpoint_slots if config.replay.live_state else 0
    spill = tiers is not None and cache.policy == "suffixreplay" and live
    return SimSystem(cache.policy, pages * page, dram, cache.checkpoint_interval,
                     cache.num_checkpoint_slots, ssd,
                     overlap=tiers is not None and tiers.enable_overlap,
                     prefetch=tiers is not None and tiers.enable_prefetch, live_slots=live,
                     shadow_states=cache.shadowed_states_first, replay=config.replay,
                     live_dram_slots=tiers.host_checkpoint_slots if spill else 0,
                     live_ssd_slots=tiers.ssd_checkpoint_slots if spill and ssd else 0)


def shapes_of(cfg, page_size: int = 64, dtype_bytes: int = 2, k_max: int = 512) -> Shapes:
    from client.bench.systems import bytes_per_anchor_block, bytes_per_checkpoint, bytes_per_page

    anchors = max(1, page_size // 16)
    return Shapes(page_size, bytes_per_page(cfg, page_size, dtype_bytes),
                  bytes_per_checkpoint(cfg, dtype_bytes),
                  bytes_per_anchor_block(cfg, anchors, dtype_bytes), anchors, cfg.num_groups,
                  k_max=k_max)
