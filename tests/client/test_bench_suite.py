"""The benchmark suite's parts: workloads, equal-budget systems, the runner, the simulator."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest

from backend.model import load_model
from backend.triton.repo import DEFAULT_MODEL, MODEL_REPO
from client.bench import sim
from client.bench import workloads as W
from client.bench.suite import measure_in_process, percentile
from client.bench.systems import (
    SGLANG,
    SYSTEMS,
    Budget,
    bytes_per_anchor_block,
    bytes_per_checkpoint,
    bytes_per_page,
    engine_config,
)


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL_REPO / DEFAULT_MODEL)


def test_workloads_are_deterministic_and_shaped():
    a, b = W.sharegpt(seed=3, sessions=2, turns=4), W.sharegpt(seed=3, sessions=2, turns=4)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert W.sharegpt(seed=4, sessions=2, turns=4).requests[0].prompt != a.requests[0].prompt
    tree = W.agentic(2000, fanout=2, depth=2)
    root = tree.requests[0].prompt
    assert len(root) == 2000 and len(tree.requests) == 1 + 2 + 4
    assert all(r.prompt[:2000] == root for r in tree.requests[1:])
    a, b = tree.requests[1].prompt, tree.requests[2].prompt  # siblings: one call, two results
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > 2000 + 60 and W.text_of(a[2000:shared]).count("<tool_call>") == 1
    narrow = W.agentic(2000, fanout=3, depth=2, grow=1)  # level 2 grows from one branch
    parents = [r.rid.rsplit(".", 1)[0] for r in narrow.requests[1:]]
    assert parents == ["root"] * 3 + ["root.0"] * 3
    sweep = W.distance_sweep(doc_tokens=1024, step=64, repeats=2)
    doc = sweep.requests[0].prompt
    assert len(sweep.requests) == 2 * 2 * 5
    for warm, r in zip(sweep.requests[::2], sweep.requests[1::2]):
        d = int(r.tag[1:])
        assert warm.prompt == doc and warm.salt == r.salt
        assert r.prompt[: 512 + d] == doc[: 512 + d]
    assert len({r.salt for r in sweep.requests}) == 10
    deep = W.distance_sweep(doc_tokens=1408, base=1024, step=128, repeats=1)
    assert [len(r.prompt) - 32 for r in deep.requests[1::2]] == [1024, 1152, 1280]
    for bad in (1000, 1280):  # off the grid; last cut past the document's end
        with pytest.raises(ValueError, match="base="):
            W.distance_sweep(doc_tokens=1408, base=bad)
    cap = W.capacity(pool_tokens=1024, factor=4, doc_tokens=256, passes=2)
    assert cap.params["docs"] == 16 and len(cap.requests) == 32


def test_systems_spend_the_same_device_budget(model):
    cfg, budget = model.config, Budget()
    page, ckpt = bytes_per_page(cfg, 64), bytes_per_checkpoint(cfg)
    anchors = bytes_per_anchor_block(cfg, 4)
    configs = {s: engine_config(s, cfg, budget, 4, Path(tempfile.mkdtemp())) for s in SYSTEMS}
    ck, sr = configs["checkpoint"].cache, configs["suffixreplay"].cache
    ck_bytes = (ck.num_kv_pages - budget.run_pages) * page + ck.num_checkpoint_slots * ckpt
    # Suffix replay's live states are paid from the budget too (up to an eighth of it).
    sr_bytes = (sr.num_kv_pages - budget.run_pages) * (page + anchors) + \
        sr.num_checkpoint_slots * ckpt
    assert 0 < sr.num_checkpoint_slots * ckpt <= budget.device_budget_bytes / 8
    for spent in (ck_bytes, sr_bytes):
        assert budget.device_budget_bytes * 0.85 <= spent <= budget.device_budget_bytes
    assert sr.num_kv_pages > ck.num_kv_pages  # anchors are cheaper than checkpoints
    assert configs["nocache"].cache.policy == "none" and configs["ours"].tiers.enable_prefetch
    assert not configs["lmcache_like"].tiers.enable_prefetch
    assert configs["lmcache_like"].tiers.enable_ssd and not configs["pcr_dram"].tiers.enable_ssd
    # ... and the same DRAM bytes: a DRAM slot holds a page's KV and its anchor block (ours),
    # or KV pages beside checkpoint slots (the checkpoint-based tiered systems).
    # Ours also spills its live states below the device, into up to an eighth of DRAM.
    dram = budget.host_pages * page
    ours, pcr = configs["ours"].tiers, configs["pcr_full"].tiers
    assert 0 < ours.host_checkpoint_slots * ckpt <= dram / 8 and ours.ssd_checkpoint_slots
    for spent in (ours.host_pages * (page + anchors) + ours.host_checkpoint_slots * ckpt,
                  pcr.host_pages * page + pcr.host_checkpoint_slots * ckpt):
        assert dram * 0.85 <= spent <= dram
    # ... and the same SSD bytes, state files included (they were on top of the checkpoint
    # systems' page budget: 1 GiB + 461 MiB of states against ours' 1 GiB + 128 MiB; the
    # tiers now set the state files aside from ssd_bytes)
    for tiers in (ours, pcr):
        assert tiers.ssd_bytes == budget.ssd_bytes
        assert 0 < tiers.ssd_checkpoint_slots * ckpt < budget.ssd_bytes
    # Look-ahead eviction is full PCR's: the other systems evict plain LRU.
    assert {s for s, c in configs.items() if c.cache.lookahead_window} == {"pcr_full", "ours"}


def test_a_small_budget_holds_the_checkpoint_systems_too(model):
    """Under RAG's 2 MiB the checkpoint systems kept 8 pages and added a 4-slot floor on
    top: 2.64 MiB against suffix replay's 1.99 MiB."""
    from client.bench.run_suite import RAG_BUDGET

    cfg, budget = model.config, RAG_BUDGET
    page, ckpt = bytes_per_page(cfg, 64), bytes_per_checkpoint(cfg)
    for system in ("checkpoint", "pcr_full", "lmcache_like"):
        cache = engine_config(system, cfg, budget, 4, Path(tempfile.mkdtemp())).cache
        assert cache.num_checkpoint_slots >= 1 and cache.num_kv_pages > budget.run_pages
        spent = (cache.num_kv_pages - budget.run_pages) * page + cache.num_checkpoint_slots * ckpt
        assert spent <= budget.device_budget_bytes, system


def test_branches_hit_deeper_with_suffix_replay_than_with_checkpoints(model):
    wl = W.sharegpt(seed=1, sessions=2, turns=4, branch_prob=0.6)
    budget = Budget(host_pages=64)
    runs = {s: measure_in_process(model, engine_config(s, model.config, budget, 4), wl)
            for s in ("nocache", "checkpoint", "suffixreplay")}
    for summary, records in runs.values():
        assert summary["errors"] == 0 and len(records) == len(wl.requests)
        assert all(r["output_tokens"] == 8 for r in records)
    assert runs["nocache"][0]["hit_rate"] == 0
    cached = {s: sum(r["cached_tokens"] for r in recs if r["tag"] == "branch")
              for s, (_, recs) in runs.items()}
    assert cached["suffixreplay"] > cached["checkpoint"] > 0
    assert runs["suffixreplay"][0]["replayed_anchors"] + runs["suffixreplay"][0][
        "live_state_hits"] > 0


def test_sglang_placement_resumes_siblings_at_the_parent_then_the_branch_point(model):
    """A tool call's siblings under SGLang's placement: the first two resume at the parent
    prompt's end (no state inside the call), the second saves the branch point and the third
    resumes there; suffix replay resumes every sibling at the last page of the shared call."""
    wl = W.agentic(2000, fanout=3, depth=1)
    calls = [r.prompt for r in wl.requests[1:]]
    shared = next(i for i, (x, y) in enumerate(zip(calls[0], calls[1])) if x != y)
    budget = Budget(device_budget_bytes=32 << 20)  # room for the whole tree
    runs = {s: measure_in_process(model, engine_config(s, model.config, budget, 4), wl)[1]
            for s in (SGLANG, "suffixreplay")}
    cached = {s: [r["cached_tokens"] for r in recs] for s, recs in runs.items()}
    assert cached[SGLANG] == [0, 1984, 1984, shared // 64 * 64]
    assert cached["suffixreplay"][2:] == [shared // 64 * 64] * 2


def test_in_process_interleaving_alternates_engines_and_keeps_their_caches_apart(model):
    from backend.engine import Engine
    from client.bench.suite import run_in_process_interleaved

    wl = W.sharegpt(seed=1, sessions=1, turns=4, branch_prob=0.6)
    engines = {s: Engine(model, engine_config(s, model.config, Budget(), 4))
               for s in ("suffixreplay", "checkpoint")}
    records = run_in_process_interleaved(engines, wl)
    rids = [r.rid for r in wl.requests]
    for system, recs in records.items():
        assert [r.rid for r in recs] == rids
        assert all(r.error is None and r.output_tokens == 8 for r in recs)
        engines[system].store.assert_invariants()
    pairs = list(zip(records["suffixreplay"], records["checkpoint"]))
    for (a, b), (c, d) in zip(pairs, pairs[1:]):
        assert max(a.last, b.last) <= min(c.submitted, d.submitted)
    assert {a.submitted < b.submitted for a, b in pairs} == {True, False}  # order rotates
    cached = {s: sum(r.cached_tokens for r in recs) for s, recs in records.items()}
    assert cached["suffixreplay"] > cached["checkpoint"] > 0


def test_served_prompts_are_the_workloads_token_ids():
    """What a served run sends (`text_of`) the server's tokenizer turns back into the very ids
    the in-process runs and the simulator use: special tokens included (ChatML markers are one
    token each), no character lost at a slice's edge."""
    from backend.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL_REPO / DEFAULT_MODEL)
    corpus = W.rag_corpus(num_chunks=8, num_queries=6, chunk_tokens=128)
    workloads = [W.sharegpt(sessions=3, turns=5), W.agentic(3000, fanout=3, depth=2),
                 W.rag(corpus, rate=1.0), W.distance_sweep(doc_tokens=640, repeats=1),
                 W.capacity(2048, 2, doc_tokens=256, passes=1)]
    specials = 0
    for wl in workloads:
        for r in wl.requests:
            assert tok.encode(W.text_of(r.prompt), add_special_tokens=True) == r.prompt, r.rid
            specials += sum(t >= 256 for t in r.prompt)
    assert specials > 0  # the chat and tool workloads carry ChatML markers as tokens


def test_simulator_hit_rates_follow_the_policies(model):
    wl = W.sharegpt(seed=1, sessions=2, turns=4, branch_prob=0.6)
    cost = sim.CostModel(0.001, 1e-4, 1e-8, 1e-5, 1e-3)
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    hits = {p: sim.simulate(wl, sim.SimSystem(p, 64 << 20), shapes, cost)["hit_rate"]
            for p in ("none", "checkpoint", "suffixreplay")}
    assert hits["none"] == 0 < hits["checkpoint"] < hits["suffixreplay"]
    tiny = sim.simulate(wl, sim.SimSystem("suffixreplay", shapes.kv_page), shapes, cost)
    assert tiny["hit_rate"] < hits["suffixreplay"]  # a one-page budget forgets


def test_simulator_live_states_spare_replays(model):
    """Suffix replay's live states, hand-computed (each case in its own namespace): a prompt's
    end (a turn that extends it resumes there, no replay); a replayed state kept (the second
    sibling of a branch point replays nothing); and a state a page short of the match end,
    resumed from when recomputing that page (64 x 1 ms) costs less than the replay
    (k x 2 groups x per anchor)."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)  # 64-token pages, 2 groups
    doc = [(3 * i) % 251 for i in range(512)]
    reqs = [W.BenchRequest("a", doc[:200], 1, "a", salt="A"),  # live state at 192
            W.BenchRequest("turn", doc[:300], 1, "turn", salt="A"),  # resumes at 192
            W.BenchRequest("p", doc[:330], 1, "p", salt="B"),  # pages to 320, live at 320
            W.BenchRequest("b1", doc[:260] + [1] * 100, 1, "b1", salt="B"),  # 256: replay
            W.BenchRequest("b2", doc[:260] + [2] * 100, 1, "b2", salt="B"),  # 256: kept state
            W.BenchRequest("x", doc[:300], 1, "x", salt="C"),  # live at 256
            W.BenchRequest("y", doc[:420], 1, "y", salt="C"),  # pages to 384, live at 384
            W.BenchRequest("z", doc[:340] + [3] * 30, 1, "z", salt="C")]  # 320, live at 256
    wl = W.Workload("live", reqs)

    def ttft(per_anchor, live_slots=16):
        cost = sim.CostModel(0.0, 1e-3, 0.0, per_anchor, 0.0)
        out = sim.simulate(wl, sim.SimSystem("suffixreplay", 1 << 30, live_slots=live_slots),
                           shapes, cost)["ttft_by_tag_s"]
        return {t: round(v, 6) for t, v in out.items()}

    def replay(tokens, per_anchor=1e-3):
        return 2 * math.ceil(0.05 * tokens) * per_anchor

    got = ttft(1e-3)  # a replayed anchor costs a token
    assert got["turn"] == 0.108  # 108 tokens past the live state at 192, no replay
    assert got["b1"] == round(0.104 + replay(256), 6)  # no state at 256: replayed
    assert got["b2"] == 0.104  # the state b1's replay rebuilt (b1's own end is at 320)
    assert got["z"] == round(0.050 + replay(320), 6)  # replay (32 ms) < a page (64 ms)
    dear = ttft(10e-3)  # replaying 16 anchors x 2 groups: 320 ms > a page's 64
    assert dear["z"] == 0.114  # resumed at 256: 64 + 50 tokens recomputed
    none = ttft(1e-3, live_slots=0)
    assert none["turn"] == round(0.108 + replay(192), 6)
    assert none["b2"] == none["b1"]


def test_simulator_sessions_taking_turns_keep_their_states_as_the_engine_does(model):
    """4 sessions x 4 turns in turn, 6 live slots (tests/engine/test_live_states.py's
    shape): with shadowing, as the engine, every later turn resumes from its session's last
    prompt end; without it (plain LRU) the sessions cycle through the slots and replay."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    page = shapes.page_size
    history = [[(11 * s + 3 * i) % 251 for i in range(3 * page)] for s in range(4)]
    reqs = []
    for t in range(4):
        for s in range(4):
            prompt = history[s] + [(t * 31 + s * 7 + i) % 241 for i in range(page)]
            reqs.append(W.BenchRequest(f"s{s}t{t}", prompt, 1, "turn" if t else "first"))
            history[s] = prompt + [(t * 17 + s * 5 + i) % 239 for i in range(page)]
    wl = W.Workload("turns", reqs)
    cost = sim.CostModel(0.0, 1e-3, 0.0, 1e-3, 0.0)

    def turn_ttft(shadow):
        out = sim.simulate(wl, sim.SimSystem("suffixreplay", 1 << 30, live_slots=6,
                                             shadow_states=shadow), shapes, cost)
        return out["ttft_by_tag_s"]["turn"]

    # Each later turn recomputes its reply and message (2 pages) and replays nothing.
    assert turn_ttft(True) == pytest.approx(2 * page * 1e-3)
    assert turn_ttft(False) > 2 * page * 1e-3 + 1e-4


def _tier_workload(arrival=None):
    """Documents A, B, C, D (four 64-token pages each), then A again with a new page."""
    docs = [[(7 * d + i) % 251 for i in range(256)] for d in range(4)]
    reqs = [W.BenchRequest(f"d{d}", doc, 1, arrival=arrival) for d, doc in enumerate(docs)]
    reqs.append(W.BenchRequest("again", docs[0] + [5] * 64, 1, tag="again", arrival=arrival))
    return W.Workload("tiers", reqs)


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_simulator_tiers_load_hits_and_pcr_hides_the_loads(model, policy):
    """Device 4 pages, DRAM 4, SSD the rest: A's pages reach SSD by the time A comes back.
    Without PCR its TTFT is compute + the SSD read (and the resume checkpoint's, under the
    checkpoint policy); with overlap the larger of the two; with prefetch a queued request's
    SSD read happens while it waits."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    page = shapes.kv_page + (shapes.anchor_page if policy == "suffixreplay" else 0)
    read = 4 * shapes.kv_page + (shapes.checkpoint if policy == "checkpoint" else 0)
    cost = sim.CostModel(0.0, 1e-3, 0.0, 0.0, 0.0, dram_bytes_per_s=1e12,
                         ssd_bytes_per_s=read / 0.1)  # A's read: 0.1 s

    def again(arrival, overlap, prefetch):
        system = sim.SimSystem(policy, 4 * page, 4 * shapes.kv_page, 256, None,
                               100 * shapes.kv_page, overlap, prefetch)
        out = sim.simulate(_tier_workload(arrival), system, shapes, cost)
        return out["ttft_by_tag_s"]["again"], out["hit_rate"]

    sccache, hits = again(None, False, False)
    assert hits == 256 / (4 * 256 + 320)
    assert math.isclose(sccache, 0.064 + 0.1)  # 64 new tokens, then the SSD read
    assert math.isclose(again(None, True, False)[0], 0.1)  # overlapped
    assert math.isclose(again(None, True, True)[0], 0.1)  # closed loop: nothing to prefetch
    # all five arrive at once: "again" waits for 4 x 0.256 s of prefill, its read hidden
    queued = again(0.0, True, True)[0]
    assert math.isclose(queued, 4 * 0.256 + 0.064)
    assert math.isclose(again(0.0, False, False)[0], 4 * 0.256 + 0.164)
    no_ssd = sim.simulate(_tier_workload(), sim.SimSystem(policy, 4 * page, 4 * shapes.kv_page),
                          shapes, cost)
    assert no_ssd["ttft_by_tag_s"]["again"] == 0.320  # forgotten: recomputed


def test_rag_projection_compares_pcr_with_sccache_at_each_load(model):
    from client.bench.run_suite import RAG_PROJECTION_LOADS, rag_projection

    corpus = W.rag_corpus(num_chunks=8, num_queries=10, chunk_tokens=128)
    cfg = model.config
    gpu = sim.CostModel.h200(4.0, len(cfg.attention_layer_ids), cfg.num_attention_heads,
                             cfg.head_dim, 0.75)
    out = rag_projection(W.rag(corpus, rate=2.0), sim.shapes_of(cfg, dtype_bytes=2), gpu)
    assert list(out) == [f"load{u:g}" for u in RAG_PROJECTION_LOADS]
    for by_system in out.values():
        ttft = {k: v["ttft_mean_s"] for k, v in by_system.items()}
        assert ttft["pcr_full"] <= ttft["pcr_overlap"] <= ttft["lmcache_like"]
        assert len({v["hit_rate"] for v in by_system.values()}) == 1  # same cache decisions
    assert out["load0.95"]["lmcache_like"]["ttft_mean_s"] > out["load0.5"]["lmcache_like"][
        "ttft_mean_s"]  # queueing grows with the load


def test_branch_projection_compares_policies_per_budget(model):
    from client.bench.run_suite import _branch_reduction

    cfg = model.config
    gpu = sim.CostModel.h200(4.0, len(cfg.attention_layer_ids), cfg.num_attention_heads,
                             cfg.head_dim, 0.75)
    shapes = sim.shapes_of(cfg, dtype_bytes=2)
    wl = W.agentic(2_000, fanout=3, depth=2, grow=1)
    # Budgets in this model's bytes: one that holds a checkpoint for a few pages only, one
    # that holds everything (the "1GiB" / "40GiB" keys stand for tight / ample).
    runs = {f"{p}@{gib}GiB": sim.simulate(wl, sim.SimSystem(p, size), shapes, gpu)
            for gib, size in ((1, 40 * shapes.kv_page), (40, 1 << 30))
            for p in ("checkpoint", "suffixreplay")}
    red = _branch_reduction({"agentic2k": runs})["agentic2k"]
    for gib in (1, 40):
        want = 1 - runs[f"suffixreplay@{gib}GiB"]["ttft_by_tag_s"]["branch"] / runs[
            f"checkpoint@{gib}GiB"]["ttft_by_tag_s"]["branch"]
        assert math.isclose(red[f"{gib}GiB"], want)
    # Anchors page with their KV, checkpoints do not fit: only the tight budget separates them.
    assert runs["suffixreplay@1GiB"]["hit_rate"] > runs["checkpoint@1GiB"]["hit_rate"]
    assert red["1GiB"] > red["40GiB"] and red["1GiB"] > 0.3


def test_cost_model_fit_recovers_known_coefficients():
    rows = [{"recomputed": n, "context": c, "anchors": a, "ttft": 0.002 + 1e-4 * n
             + 1e-8 * n * c + 3e-5 * a, "e2el": 0.5, "output_tokens": 5}
            for n in (10, 100, 500, 1000) for c in (1000, 4000) for a in (0, 16, 64)]
    fit = sim.CostModel.fit(rows)
    assert math.isclose(fit.per_token_s, 1e-4, rel_tol=1e-3)
    assert math.isclose(fit.per_anchor_s, 3e-5, rel_tol=1e-3)


def test_percentiles():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 100) == 5
    assert math.isclose(percentile(list(range(101)), 99), 99)


def test_rag_queries_retrieve_their_source_chunk():
    corpus = W.rag_corpus(num_chunks=10, num_queries=6, top_k=3)
    assert all(len(ids) == 3 and len(set(ids)) == 3 for _, ids in corpus.queries)
    wl = W.rag(corpus, rate=4.0)
    arrivals = [r.arrival for r in wl.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    # the request is [documents : query], the documents in rank order
    text = bytes(wl.requests[0].prompt)
    first = corpus.chunks[corpus.queries[0][1][0]]
    assert text.startswith(b"<doc>\n" + first)


@pytest.mark.parametrize("below", ["none", "dram", "ssd"])
def test_simulator_suffix_replay_loads_spilled_live_states(model, below):
    """One device live slot, documents A-D, then A again (its pages on SSD by then): A's
    state at its end (256) lost its slot to B's. Without state slots below the device,
    "again" replays (26 anchors); with three DRAM slots it loads A's state from DRAM; with
    two, A's state went on to SSD (behind C's and D's) and is read with A's pages."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    page = shapes.kv_page + shapes.anchor_page
    cost = sim.CostModel(0.0, 1e-3, 0.0, 1e-3, 0.0, dram_bytes_per_s=1e12,
                         ssd_bytes_per_s=(4 * shapes.kv_page + shapes.checkpoint) / 0.1)
    dram, ssd = {"none": (0, 0), "dram": (3, 0), "ssd": (2, 8)}[below]
    system = sim.SimSystem("suffixreplay", 4 * page, 4 * shapes.kv_page, 256, None,
                           100 * shapes.kv_page, live_slots=1, live_dram_slots=dram,
                           live_ssd_slots=ssd)
    got = sim.simulate(_tier_workload(), system, shapes, cost)["ttft_by_tag_s"]["again"]
    pages = 0.1 * 4 * shapes.kv_page / (4 * shapes.kv_page + shapes.checkpoint)  # A's pages
    want = {"none": 0.064 + 2 * math.ceil(0.05 * 256) * 1e-3 + pages,
            "dram": 0.064 + pages + shapes.checkpoint / 1e12,
            "ssd": 0.064 + 0.1}[below]
    assert math.isclose(got, want), (got, want)


def test_capacity_anchors_page_through_the_tiers_and_checkpoints_do_not(model, tmp_path):
    """Working set 4x the device pool, two passes: only anchors (which page with their KV into
    DRAM and SSD) let the second pass hit. Checkpoints are gone by then: from the device
    slots, and the same DRAM bytes (8 pages) hold no checkpoint unit at all (a state is
    larger than the 4 pages it serves), with or without the KV in DRAM."""
    from client.bench.run_suite import _with_run_pages

    budget = Budget(device_budget_bytes=1 << 20, host_pages=8, ssd_bytes=64 << 20)
    pool_tokens = budget.device_budget_bytes // (bytes_per_page(model.config, 64) // 64)
    wl = W.capacity(pool_tokens, 4, doc_tokens=256, passes=2, max_tokens=1)
    budget = _with_run_pages(budget, wl)
    repeat_hits = {}
    for system in ("checkpoint", "pcr_dram", "ours"):
        config = engine_config(system, model.config, budget, 4, tmp_path / system)
        summary, records = measure_in_process(model, config, wl)
        assert summary["errors"] == 0
        assert summary["throughput_requests_per_s_by_tag"]["repeat"] > 0
        # Bytes held at the end, by pool: each system reports the tiers it has, and ours
        # holds more of the 4x working set on SSD than on the device.
        memory = summary["memory_bytes"]
        lower = {"checkpoint": set(), "pcr_dram": {"host"}, "ours": {"host", "ssd"}}[system]
        assert set(memory) - {"device_kv", "device_anchors", "device_states"} == lower, memory
        assert memory["device_kv"] > 0
        if system == "ours":
            assert memory["ssd"] > memory["device_kv"] and memory["device_anchors"] > 0, memory
        repeat = [r for r in records if r["tag"] == "repeat"]
        repeat_hits[system] = sum(r["cached_tokens"] for r in repeat) / sum(
            r["prompt_tokens"] for r in repeat)
    assert repeat_hits["checkpoint"] == repeat_hits["pcr_dram"] == 0, repeat_hits
    assert repeat_hits["ours"] > 0.5, repeat_hits


def test_simulator_keeps_cache_namespaces_apart(model):
    prompt = [i % 200 for i in range(512)]
    wl = W.Workload("salts", [W.BenchRequest(rid, prompt, 1, salt=salt)
                              for rid, salt in (("a", "s1"), ("b", "s2"), ("c", "s1"))])
    out = sim.simulate(wl, sim.SimSystem("suffixreplay", 1 << 30), sim.shapes_of(model.config),
                       sim.CostModel(0.0, 1e-3, 0.0, 0.0, 0.0))
    assert out["hit_rate"] == 448 / (3 * 512)  # only "c" hits: 7 whole pages before the last token


@pytest.mark.parametrize("quick", [True, False])
def test_suite_plans_build_valid_jobs(model, quick, tmp_path):
    """Both plans (`run --quick` and the never-cheap `--full`) build their workloads, and every
    (system, budget) they would serve is a valid engine configuration with room for the
    longest request of its workloads."""
    from types import SimpleNamespace

    from client.bench.run_suite import BRANCH_BUDGET, build_jobs, plan

    runner = SimpleNamespace(cfg=model.config, budget=BRANCH_BUDGET)
    jobs = build_jobs(plan(quick), runner)
    kinds = {kind for kind, *_ in jobs}
    assert kinds == {"sharegpt", "agentic", "rag", "sweep", "capacity"}
    assert len({wl.name for _, wl, _, _ in jobs}) == len(jobs)  # one result per workload
    assert set().union(*(systems for *_, systems, _ in jobs)) == set(SYSTEMS + (SGLANG,))
    for _, wl, systems, budget in jobs:
        assert wl.requests and set(systems) <= set(SYSTEMS + (SGLANG,))
        longest = max(len(r.prompt) + r.max_tokens for r in wl.requests)
        assert budget.run_pages * budget.page_size >= longest
        for system in systems:
            config = engine_config(system, model.config, budget, 128, tmp_path / system)
            assert config.cache.num_kv_pages > budget.run_pages or system == "nocache"


def _sweep_summary(warm_ms: float, cut_ms: dict[str, float]) -> dict:
    tags = {"warm": {"mean": warm_ms, "p50": warm_ms}}
    tags.update({t: {"mean": v, "p50": v} for t, v in cut_ms.items()})
    every = [warm_ms, *cut_ms.values()]
    return {"ttft_ms_by_tag": tags, "ttft_ms": {"mean": sum(every) / len(every)}}


def test_distance_sweep_reduction_is_over_the_cuts_not_the_warm_ups():
    """The warm-up requests (the whole document, uncached in each cut's namespace) cost every
    system the same; the key compares the cuts."""
    from client.bench.run_suite import ratios

    sweep = {"suffixreplay": _sweep_summary(900.0, {"d0": 50.0, "d64": 50.0}),
             "checkpoint": _sweep_summary(900.0, {"d0": 50.0, "d64": 150.0}),
             SGLANG: _sweep_summary(900.0, {"d0": 100.0, "d64": 100.0})}
    r = ratios({"distance_sweep": sweep}, {"rates": []})
    assert r["distance_sweep_ttft_reduction_vs_sglang"] == pytest.approx(0.5)
    assert r["checkpoint_distance_ttft_max_over_min_checkpoint"] == pytest.approx(3.0)
    assert r["checkpoint_distance_ttft_max_over_min_suffixreplay"] == pytest.approx(1.0)


def test_summary_json_has_no_nan(tmp_path):
    """ITL of one-token requests is NaN: written as null, so strict JSON parsers read it."""
    import json

    from client.bench.report import _fmt
    from client.bench.run_suite import _dump

    _dump(tmp_path / "s.json", {"itl_ms": {"mean": float("nan")}, "x": [1.5, float("inf")]})
    text = (tmp_path / "s.json").read_text()
    assert "NaN" not in text and "Infinity" not in text

    def strict(token):
        raise ValueError(token)

    back = json.loads(text, parse_constant=strict)
    assert back == {"itl_ms": {"mean": None}, "x": [1.5, None]}
    assert _fmt(back["itl_ms"]["mean"]) == "n/a"


def _tiny_suite(monkeypatch, tmp_path, **changes):
    """A plan of a few requests a workload (`changes` on top), results under `tmp_path`;
    returns the arguments of an in-process run of it named "run"."""
    import argparse

    from client.bench import run_suite

    tiny = {"branch_systems": ("checkpoint", "suffixreplay"), "sharegpt": dict(sessions=1,
            turns=2), "agentic": [], "agentic_fanout": 2, "agentic_depth": 1,
            "agentic_grow": 1, "rag": dict(num_chunks=4, num_queries=2, chunk_tokens=64),
            "rates": [1.0], "sweep_step": 128, "sweep_doc_tokens": 640, "sweep_base": 256,
            "sweep_repeats": 1, "capacity": [], "capacity_passes": 1,
            "capacity_doc_tokens": 256, **changes}
    monkeypatch.setattr(run_suite, "plan", lambda quick: tiny)
    monkeypatch.setattr(run_suite, "RESULTS_ROOT", tmp_path)
    return argparse.Namespace(full=False, in_process=True,
                              model=str(MODEL_REPO / DEFAULT_MODEL), out="run", force=False)


def test_an_interrupted_suite_run_keeps_what_finished(tmp_path, monkeypatch):
    """Each finished run is on disk (partial.json, records.json) as soon as it finishes: a
    Ctrl-C or a timeout in a later run loses only that run. And a finished run is not
    overwritten unless asked to."""
    import json

    from client.bench import run_suite

    args = _tiny_suite(monkeypatch, tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_suite.Runner, "run_system", interrupted)  # RAG runs one by one
    with pytest.raises(KeyboardInterrupt):
        run_suite.run(args)
    out = tmp_path / "run"
    assert not (out / "summary.json").exists()
    partial = json.loads((out / "partial.json").read_text())["results"]
    assert set(partial) == {"sharegpt", "distance_sweep"}  # the interleaved runs, all done
    assert set(partial["sharegpt"]) == {"checkpoint", "suffixreplay"}
    assert set(partial["distance_sweep"]) == set(run_suite.SWEEP_SYSTEMS)
    records = json.loads((out / "records.json").read_text())
    assert len(records["sharegpt/suffixreplay"]) == partial["sharegpt"]["suffixreplay"]["requests"]

    (out / "summary.json").write_text("{}")  # a finished run
    with pytest.raises(SystemExit, match="--force"):
        run_suite.run(args)


def test_a_finished_suite_run_writes_intervals_beside_its_keys(tmp_path, monkeypatch):
    """A whole (tiny, in-process) run: summary.json holds each ratio key with its bootstrap
    interval from the run's own records, and report.md places the goal against it."""
    import json

    from client.bench import run_suite

    # Branch requests (4) and RAG queries (4) enough to resample.
    run_suite.run(_tiny_suite(monkeypatch, tmp_path, sharegpt=dict(sessions=3, turns=4),
                              rag=dict(num_chunks=4, num_queries=4, chunk_tokens=64),
                              rates=[4.0]))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    intervals = summary["key_intervals"]
    assert set(intervals) == {"branching_ttft_reduction_vs_checkpoint_sharegpt",
                              "pcr_ttft_speedup_vs_sccache", "pcr_ttft_speedup_vs_nocache"}
    for key, (lo, hi) in intervals.items():
        assert lo <= summary[key] <= hi, key  # ratios of means: the key lies within
    report = (tmp_path / "run" / "report.md").read_text()
    lo, hi = intervals["pcr_ttft_speedup_vs_sccache"]
    assert f"| `pcr_ttft_speedup_vs_sccache` | {summary['pcr_ttft_speedup_vs_sccache']:.3f} | " \
           f"{lo:.3f} to {hi:.3f} | >= 1.3 |" in report

    # `python -m client.bench report` recomputes all of it from the run's files, with the
    # plan the run stored (not today's).
    from client.bench.__main__ import main

    monkeypatch.undo()
    out = tmp_path / "run"
    (out / "report.md").unlink()
    stripped = {k: v for k, v in summary.items() if k not in ("key_intervals",
                                                             "sim_validation_error")}
    (out / "summary.json").write_text(json.dumps(stripped))
    assert main(["report", str(out)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["key_intervals"] == intervals
    assert again["sim_validation_error"] == pytest.approx(summary["sim_validation_error"])
    assert (out / "report.md").read_text() == report
    with pytest.raises(SystemExit, match="no finished run"):
        main(["report", str(tmp_path / "nothing")])


_DOC = [(7 * i + 3) % 251 for i in range(2048)]
_OTHER = [(11 * i + 5) % 241 for i in range(2048)]
_PER_TOKEN = sim.CostModel(0.0, 1e-3, 0.0, 0.0, 0.0)  # TTFT = recomputed tokens x 1 ms


def _cached(out: dict, wl: W.Workload) -> dict[str, int]:
    """Each tag's cached tokens (one request a tag), read back from its TTFT."""
    prompt = {r.tag: len(r.prompt) for r in wl.requests}
    return {t: prompt[t] - round(s / 1e-3) for t, s in out["ttft_by_tag_s"].items()}


def test_simulator_evicts_the_deepest_pages_first_as_the_engine(model):
    """A device of 5 pages: A (4 pages), then B (2 pages) makes room for one. The engine evicts
    a leaf, A's last page, and A comes back hitting 3 pages (seen in-process); the simulator
    evicted A's first page (the least recently touched), which stranded the other three."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    R = W.BenchRequest
    wl = W.Workload("evict", [R("A", _DOC[:257], 1, tag="A", salt="a"),
                              R("B", _OTHER[:129], 1, tag="B", salt="b"),
                              R("A2", _DOC[:257] + [9] * 10, 1, tag="A2", salt="a")])
    page = shapes.kv_page + shapes.anchor_page
    out = sim.simulate(wl, sim.SimSystem("suffixreplay", 5 * page), shapes, _PER_TOKEN)
    assert _cached(out, wl) == {"A": 0, "B": 0, "A2": 192}


def test_simulator_saves_checkpoints_past_the_resume_point_only(model):
    """Three checkpoint slots. A2 resumes from A's state at 512 and saves one at 576 (the
    engine saves past its resume point only: A's state at 256 is not touched again and goes);
    so the branch of A at 300 finds no state at 256 and Q's is gone too (seen in-process:
    512 / 0 / 0). The simulator re-saved every checkpoint along A2's prompt, keeping 256."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    R = W.BenchRequest
    wl = W.Workload("ckpt", [R("A", _DOC[:513], 1, tag="A", salt="a"),
                             R("Q", _OTHER[:257], 1, tag="Q", salt="q"),
                             R("A2", _DOC[:600], 1, tag="A2", salt="a"),
                             R("Abr", _DOC[:300] + [1] * 100, 1, tag="Abr", salt="a"),
                             R("Q2", _OTHER[:257] + [2] * 100, 1, tag="Q2", salt="q")])
    system = sim.SimSystem("checkpoint", 1 << 30, checkpoint_slots=3)
    assert _cached(sim.simulate(wl, system, shapes, _PER_TOKEN), wl) == {
        "A": 0, "Q": 0, "A2": 512, "Abr": 0, "Q2": 0}


def test_simulator_keeps_the_checkpoint_of_a_page_back_on_the_device(model):
    """Checkpoint policy over device (5 pages) + DRAM (4): A's pages go to DRAM, A2 brings
    them back, and when DRAM drops its now stale copies A's state still rides with its pages
    on the device: A3 hits 192 tokens (seen in-process); the simulator forgot the state."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    R = W.BenchRequest
    wl = W.Workload("tiered", [R("A", _DOC[:193], 1, tag="A", salt="a"),
                               R("B", _OTHER[:321], 1, tag="B", salt="b"),
                               R("A2", _DOC[:193] + [5] * 64, 1, tag="A2", salt="a"),
                               R("A3", _DOC[:193] + [6] * 64, 1, tag="A3", salt="a")])
    system = sim.SimSystem("checkpoint", 5 * shapes.kv_page, 4 * shapes.kv_page,
                           checkpoint_slots=8)
    cached = _cached(sim.simulate(wl, system, shapes, _PER_TOKEN), wl)
    assert cached["A2"] == cached["A3"] == 192


def test_simulator_open_loop_throughput_is_over_the_span(model):
    """Four requests arriving at once on one server, 0.1 s each: 10 requests a second (it
    was 1 / mean end-to-end latency: 4 a second)."""
    shapes = sim.shapes_of(model.config, dtype_bytes=4)
    wl = W.Workload("burst", [W.BenchRequest(f"r{i}", [i + 1] * 100, 1, arrival=0.0)
                              for i in range(4)])
    out = sim.simulate(wl, sim.SimSystem("none", 1 << 30), shapes, _PER_TOKEN)
    assert math.isclose(out["throughput_requests_per_s"], 10.0)
    with pytest.raises(ValueError, match="no requests"):
        sim.simulate(W.Workload("empty", []), sim.SimSystem("none", 1 << 30), shapes,
                     _PER_TOKEN)
    with pytest.raises(ValueError, match="at least one"):
        sim.CostModel.fit([])


def test_fit_rows_count_anchors_per_group():
    """The engine records k anchors a replay; the simulator charges each group's replay of
    them, so the fit's anchors are k x groups (they were k: the fitted per-anchor cost was
    `groups` times the simulator's). RAG and failed requests are left out."""
    from client.bench.run_suite import fit_rows

    rec = {"prompt_tokens": 300, "cached_tokens": 256, "replayed_anchors": 16, "ttft": 0.05,
           "e2el": 0.2, "output_tokens": 4}
    rows = fit_rows({"agentic5k/suffixreplay": [rec, {**rec, "error": "x"}],
                     "rag_r1/ours": [rec]}, groups=3)
    assert rows == {"agentic5k": [{"recomputed": 44, "context": 300, "anchors": 48,
                                   "ttft": 0.05, "e2el": 0.2, "output_tokens": 4}]}


def test_h200_attention_cost_uses_the_query_heads():
    """4 x layers x query heads x head_dim FLOPs a token pair (it assumed 8 query heads per
    KV head: 2x for Qwen3.5-4B's 16 / 4)."""
    gpu = sim.CostModel.h200(4.0, 8, 16, 256, 0.25)
    assert math.isclose(gpu.per_token_ctx_s, 4 * 8 * 16 * 256 / (989e12 * 0.4))


def test_simulator_counts_the_decode_state_a_request_leaves_as_the_engine(model):
    """Three live-state slots. A request whose output crosses a page boundary leaves two
    states (its prompt's last page boundary and its output's), so after A and B the first
    to come, A's prompt end, is gone and A's next turn replays (seen in-process, the engine
    beside the simulator's twin); the simulator kept one state a request and resumed A2
    from a live state."""
    cfg = model.config
    shapes = sim.shapes_of(cfg, dtype_bytes=4, k_max=64)
    unit = sim.CostModel(0.0, 0.0, 0.0, 1.0, 0.0)  # TTFT = anchors replayed (x groups)
    R = W.BenchRequest
    wl = W.Workload("decode", [R("A", _DOC[:150], 60, tag="A", salt="a"),
                               R("B", _OTHER[:150], 60, tag="B", salt="b"),
                               R("A2", _DOC[:150] + [7] * 60, 4, tag="A2", salt="a")])
    from dataclasses import replace

    config = engine_config("suffixreplay", cfg, Budget(), 64)
    config = replace(config, cache=replace(config.cache, num_checkpoint_slots=3))
    twin = sim.system_of(config, shapes)
    assert twin.live_slots == 3
    out = sim.simulate(wl, twin, shapes, unit)
    _, records = measure_in_process(model, config, wl)
    engine = {req.tag: (r["cached_tokens"], r["replayed_anchors"])
              for req, r in zip(wl.requests, records)}
    assert engine["A2"][0] == 128 and engine["A2"][1] > 0  # replayed
    assert round(out["ttft_by_tag_s"]["A2"]) == engine["A2"][1] * shapes.groups


def test_a_bad_model_is_a_usage_error_before_any_work(tmp_path, capsys):
    """`run --model` / `report --model` naming no checkpoint ended in a traceback, `run`
    after making its results folder; now exit 2 saying so."""
    from client.bench.run_suite import RESULTS_ROOT, main, report_main

    for command, argv in ((main, ["--in-process", "--model", str(tmp_path / "none"),
                                  "--out", "bad-model-test"]),
                          (report_main, ["some_run", "--model", str(tmp_path / "none")])):
        with pytest.raises(SystemExit) as exit_:
            command(argv)
        assert exit_.value.code == 2
        assert "no model folder (config.json) there" in capsys.readouterr().err
    assert not (RESULTS_ROOT / "bad-model-test").exists()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "odd"), "--out", "bad-model-test"])
    assert "--model " in capsys.readouterr().err
