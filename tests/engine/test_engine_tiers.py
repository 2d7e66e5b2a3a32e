"""The engine over the PCR tiers: pages evicted from the device come back from DRAM or SSD
(also after a restart) and give the same tokens as a full prefill; on both model families."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from engine_helpers import (
    GREEDY,
    assert_no_leak,
    make_engine,
    random_prompt,
)

from backend.cache.io_pool import Priority
from backend.cache.state_tier import StateLayout
from backend.cache.tier_config import TierConfig
from backend.engine import Engine
from backend.engine.request import Request
from backend.model.generate import greedy_generate
from backend.replay.budget import ReplayConfig

CHECKPOINT = (5, False)  # seed, slow decay (conftest.family_model)


@pytest.fixture(scope="module")
def model(family_model):
    """Every family of `engine_helpers.FAMILIES`."""
    return family_model


def tiered(model, tiers: TierConfig, num_kv_pages=24) -> Engine:
    base = make_engine(model, num_kv_pages=num_kv_pages, max_tokens_per_step=200)
    return Engine(model, replace(base.config, tiers=tiers))


def _greedy(model, prompt):
    """What a full prefill decodes (GREEDY's 12 tokens)."""
    return greedy_generate(model, [prompt], max_new_tokens=12, page_size=16)[0]


def _run(engine, model, prompts):
    """Caches prompts[0], pushes it off the device with the others, then asks for a branch."""
    for p in prompts:
        engine.generate(p, GREEDY)
    branch = prompts[0][:150] + prompts[1][:30]
    want = _greedy(model, branch)
    got = engine.generate(branch, GREEDY)
    assert got.new_token_ids == want
    return got


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_dram_tier_serves_evicted_pages(model, overlap):
    prompts = [random_prompt(200, 97, seed=s) for s in range(4)]
    engine = tiered(model, TierConfig(host_pages=64, enable_overlap=overlap))
    got = _run(engine, model, prompts)
    stats = engine.stats()
    assert got.cached_tokens == 144
    assert stats["cache"]["pages_demoted"] > 0 and stats["cache"]["pages_promoted"] > 0
    assert stats["cache"]["hit_tokens_by_tier"]["host"] >= 144
    assert stats["memory_bytes"]["host"] > 0 and "ssd" not in stats["memory_bytes"]  # no SSD
    assert_no_leak(engine)
    engine.stop()


def _fill_ssd(engine: Engine, seeds) -> list[list[int]]:
    """Runs a 200-token prompt per seed through `engine`, writes everything to SSD and stops
    it: a new engine over the same directory finds the pages there. Returns the prompts."""
    prompts = [random_prompt(200, 97, seed=s) for s in seeds]
    for p in prompts:
        engine.generate(p, GREEDY)
    engine.tiers.drain()
    assert engine.stats()["tiers"]["ssd_bytes_written"] > 0
    engine.stop()
    return prompts


def test_ssd_tier_survives_restart(model, tmp_path):
    cfg = TierConfig(host_pages=12, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m1",
                     ssd_bytes=1 << 30)
    prompts = _fill_ssd(tiered(model, cfg), range(10, 14))
    # A new engine over the same directory: the first prompt's pages come from SSD.
    restarted = tiered(model, cfg)
    branch = prompts[0][:150] + prompts[1][:30]
    want = _greedy(model, branch)
    got = restarted.generate(branch, GREEDY)
    assert got.new_token_ids == want
    assert got.cached_tokens == 144
    assert restarted.stats()["tiers"]["ssd_bytes_read"] > 0
    assert_no_leak(restarted)
    restarted.stop()


@pytest.mark.parametrize("sampling", ["dense_tail", "uniform"])
def test_anchors_written_under_another_sampling_are_a_miss(model, tmp_path, sampling):
    """A page's anchor block holds the hidden states at its sampled positions: the same bytes
    read under the other sampling would be taken for other positions and replay a state no
    configuration computes. Restarted with the other `sampling`, the SSD chunks are refused
    (their layout names the sampling) and the branch is prefilled in full; restarted with the
    same one (first: a miss writes the branch's pages again, under its own layout), they are
    hits."""
    other = {"dense_tail": "uniform", "uniform": "dense_tail"}[sampling]
    cfg = TierConfig(host_pages=12, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m1",
                     ssd_bytes=1 << 30)

    def engine(sampling):
        replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8,
                              live_state=False, sampling=sampling)
        base = make_engine(model, replay=replay, num_kv_pages=24, max_tokens_per_step=200)
        return Engine(model, replace(base.config, tiers=cfg))

    prompts = _fill_ssd(engine(sampling), range(20, 24))
    branch = prompts[0][:150] + prompts[1][:30]
    for reader, hit in ((sampling, True), (other, False)):
        restarted = engine(reader)
        got = restarted.generate(branch, GREEDY)
        stats = restarted.stats()["tiers"]
        if hit:
            assert got.cached_tokens == 144 and got.replayed_anchors > 0
        else:
            assert got.cached_tokens == 0 and got.replayed_anchors == 0
            assert stats["chunk_rejects"].get("layout_mismatch", 0) > 0, stats["chunk_rejects"]
            assert got.new_token_ids == _greedy(model, branch)
        assert_no_leak(restarted)
        restarted.stop()


def test_hit_counters_count_the_pages_a_request_used(model, tmp_path):
    """Pages stage from SSD through DRAM: with 4 DRAM slots a restarted engine can use 4 of
    the branch's 9 cached pages (the rest is recomputed, with the same tokens). The hit
    counters count the pages used, by the tier each came from, not every page matched."""
    cfg = TierConfig(host_pages=12, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m1",
                     ssd_bytes=1 << 30)
    prompts = _fill_ssd(tiered(model, cfg), range(50, 54))
    restarted = tiered(model, replace(cfg, host_pages=4))
    branch = prompts[0][:150] + prompts[1][:30]
    got = restarted.generate(branch, GREEDY)
    assert got.new_token_ids == _greedy(model, branch)
    hits = restarted.stats()["cache"]["hit_tokens_by_tier"]
    assert 0 < got.cached_tokens < 144
    assert sum(hits.values()) == got.cached_tokens and hits["device"] == 0, hits
    assert_no_leak(restarted)
    restarted.stop()


@pytest.mark.parametrize("where", ["dram", "ssd"])
def test_int8_anchors_tier_with_their_pages(model, tmp_path, where):
    """int8 anchors (rows and their per-row scales) go down to DRAM or SSD with their pages
    and come back bit for bit: the branch replays them into the logits of an engine that
    never evicted them (SSD: after a restart)."""
    replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8,
                          anchor_dtype="int8", live_state=False)
    prompts = [random_prompt(200, 97, seed=s) for s in range(20, 24)]
    branch = prompts[0][:150] + prompts[1][:30]
    reference = make_engine(model, replay=replay, max_tokens_per_step=200)
    reference.generate(prompts[0], GREEDY)
    want = reference.generate(branch, GREEDY, return_first_logits=True)
    tiers = (TierConfig(host_pages=64) if where == "dram" else
             TierConfig(host_pages=12, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m1",
                        ssd_bytes=1 << 30))
    config = replace(make_engine(model, replay=replay, num_kv_pages=24,
                                 max_tokens_per_step=200).config, tiers=tiers)
    engine = Engine(model, config)
    for p in prompts:
        engine.generate(p, GREEDY)
    if where == "ssd":
        engine.tiers.drain()
        engine.stop()
        engine = Engine(model, config)
    got = engine.generate(branch, GREEDY, return_first_logits=True)
    assert engine.executor.anchors.dtype == torch.int8
    assert got.cached_tokens == want.cached_tokens == 144
    assert got.replayed_anchors == want.replayed_anchors > 0
    assert torch.equal(got.first_logits, want.first_logits)
    assert got.new_token_ids == want.new_token_ids
    tier = "host" if where == "dram" else "ssd"
    assert engine.stats()["cache"]["hit_tokens_by_tier"][tier] > 0
    assert_no_leak(engine)
    engine.stop()


def _state_tiers(where: str, tmp_path) -> TierConfig:
    """A DRAM tier of 64 pages; the saved states that lose their device slot go `where`:
    nowhere, 16 DRAM slots, or one DRAM slot staging 16 SSD files."""
    slots = {"none": dict(), "dram": dict(host_checkpoint_slots=16),
             "ssd": dict(host_checkpoint_slots=1, ssd_checkpoint_slots=16,
                         ssd_path=str(tmp_path / "ssd"), model_fingerprint="m")}[where]
    return TierConfig(host_pages=64, **slots)


def _cache_prompts(engine: Engine, seeds) -> list[list[int]]:
    """A 200-token prompt per seed, generated in turn (the earlier ones' pages and states
    pushed down the tiers by the later ones); returns the prompts once the state writes
    are done."""
    prompts = [random_prompt(200, 97, seed=s) for s in seeds]
    for p in prompts:
        engine.generate(p, GREEDY)
    if engine.tiers.states is not None:
        engine.tiers.drain()
    return prompts


@pytest.mark.parametrize("where", ["none", "dram", "ssd"])
def test_checkpoint_states_tier_with_their_pages(model, tmp_path, where):
    """Checkpoint policy over the tiers: the branch's pages were pushed to DRAM and their
    checkpoint slots reclaimed; with state slots below the device it resumes at the deepest
    checkpoint (128 of its 150 shared tokens) and decodes what a full prefill decodes."""
    base = make_engine(model, policy="checkpoint", num_kv_pages=24, max_tokens_per_step=200,
                       num_checkpoint_slots=3)
    engine = Engine(model, replace(base.config, tiers=_state_tiers(where, tmp_path)))
    prompts = _cache_prompts(engine, range(20, 24))
    branch = prompts[0][:150] + prompts[1][:30]
    want = _greedy(model, branch)
    got = engine.generate(branch, GREEDY)
    assert got.new_token_ids == want
    tiers = engine.stats()["tiers"]
    if where == "none":
        assert got.cached_tokens == 0  # its KV is in DRAM, its states are gone
    else:
        assert got.cached_tokens == 128
        assert tiers["state_spills"] > 0
        loads = tiers["state_loads_host"] + tiers["state_loads_ssd"]
        assert loads == 1, tiers
    if where == "ssd":
        assert tiers["state_ssd_writes"] > 0 and tiers["ssd_reads"] > 0
    assert_no_leak(engine)
    engine.tiers.assert_invariants()
    engine.stop()


def _live_state_engine(model, tmp_path, where: str, replay=None) -> Engine:
    """Suffix replay with two live-state slots over `_state_tiers(where)`."""
    base = make_engine(model, replay=replay, num_kv_pages=24, max_tokens_per_step=200,
                       num_checkpoint_slots=2)
    return Engine(model, replace(base.config, tiers=_state_tiers(where, tmp_path)))


@pytest.mark.parametrize("where", ["none", "dram", "ssd"])
def test_suffix_replay_live_states_spill_below_the_device(model, tmp_path, where):
    """Suffix replay with two live-state slots: the first prompt's state at its last page
    boundary (192 tokens) loses its slot to the later prompts' and its pages go to DRAM.
    With state slots below the device, a prompt that matches exactly those 192 tokens loads
    the spilled state instead of replaying (the default budgeted replay is approximate: the
    loaded state is the prefill's own) and decodes what a full prefill decodes; without
    them it replays."""
    engine = _live_state_engine(model, tmp_path, where)
    prompts = _cache_prompts(engine, range(30, 34))
    branch = prompts[0][:192] + prompts[1][:30]
    got = engine.generate(branch, GREEDY)
    assert got.cached_tokens == 192
    tiers = engine.stats()["tiers"]
    if where == "none":
        assert engine.tiers.states is None and got.replayed_anchors > 0
    else:
        assert got.replayed_anchors == 0
        assert got.new_token_ids == _greedy(model, branch)
        assert tiers["state_spills"] > 0
        assert tiers["state_loads_host"] + tiers["state_loads_ssd"] == 1, tiers
    if where == "ssd":
        assert tiers["state_ssd_writes"] > 0 and tiers["ssd_reads"] > 0
    assert_no_leak(engine)
    engine.tiers.assert_invariants()
    engine.stop()


@pytest.mark.parametrize("change", ["same", "k_max", "flipped"])
def test_spilled_live_state_files_hold_for_their_replay_configuration(model, tmp_path,
                                                                      change):
    """Suffix replay over SSD, restarted: the branch's pages and the live state file of its
    match's end come back, and it loads that state instead of replaying. A live state may
    be a replayed one, right only for the replay configuration that rebuilt it: restarted
    with another k_max the files are refused (a header mismatch, deleted at start-up) and the branch
    replays; a flipped file is a miss too. Tokens are checked against a full prefill
    where the state is loaded (exact) and against a fresh engine of the restarted
    configuration where it replays."""
    replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8)
    engine = _live_state_engine(model, tmp_path, "ssd", replay)
    prompts = _cache_prompts(engine, range(30, 34))
    config = engine.config
    engine.stop()
    files = sorted((tmp_path / "ssd" / "states").iterdir())
    assert files
    if change == "flipped":
        for f in files:
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF  # the payload's last byte: the checksum catches it
            f.write_bytes(bytes(data))
    if change == "k_max":
        config = replace(config, replay=replace(replay, k_max=4))
    restarted = Engine(model, config)
    branch = prompts[0][:192] + prompts[1][:30]
    got = restarted.generate(branch, GREEDY)
    stats = restarted.stats()["tiers"]
    assert got.cached_tokens == 192
    # (another replay configuration's files are refused by their headers at start-up)
    assert stats["restored_state_files"] == (0 if change == "k_max" else len(files))
    if change == "same":
        assert got.replayed_anchors == 0
        assert got.new_token_ids == _greedy(model, branch)
        assert stats["state_loads_host"] + stats["state_loads_ssd"] == 1, stats
    else:
        assert got.replayed_anchors > 0
        reason = "state_checksum" if change == "flipped" else "state_layout_mismatch"
        assert stats["chunk_rejects"].get(reason, 0) >= 1, stats["chunk_rejects"]
        # What that replay gives: the same anchors (prompts[0]'s prefill) replayed by an
        # engine that keeps no live state.
        fresh = make_engine(model, replay=replace(config.replay, live_state=False),
                            num_kv_pages=24, max_tokens_per_step=200)
        fresh.generate(prompts[0], GREEDY)
        again = fresh.generate(branch, GREEDY)
        assert again.replayed_anchors == got.replayed_anchors
        assert got.new_token_ids == again.new_token_ids
        fresh.stop()
    assert_no_leak(restarted)
    restarted.tiers.assert_invariants()
    restarted.stop()


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "flipped"])
def test_checkpoint_states_survive_restart(model, tmp_path, corrupt):
    """Checkpoint policy with SSD tiers, restarted: the branch's KV pages come back from SSD
    with the state files the first run spilled, and it resumes at the deepest checkpoint
    (128 of 150 shared tokens). A flipped state file is a miss, never a wrong state: then
    nothing of the branch is usable and it is prefilled, with the same tokens."""
    tiers = TierConfig(host_pages=64, host_checkpoint_slots=1, ssd_checkpoint_slots=16,
                       ssd_path=str(tmp_path / "ssd"), model_fingerprint="m",
                       ssd_bytes=1 << 30)
    base = make_engine(model, policy="checkpoint", num_kv_pages=24, max_tokens_per_step=200,
                       num_checkpoint_slots=3)
    config = replace(base.config, tiers=tiers)
    engine = Engine(model, config)
    prompts = [random_prompt(200, 97, seed=s) for s in range(20, 24)]
    for p in prompts:
        engine.generate(p, GREEDY)
    engine.tiers.drain()
    assert engine.stats()["tiers"]["state_ssd_writes"] > 0
    engine.stop()
    files = sorted((tmp_path / "ssd" / "states").iterdir())
    assert files
    if corrupt:
        for f in files:
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF  # the payload's last byte: the checksum catches it
            f.write_bytes(bytes(data))
    restarted = Engine(model, config)
    branch = prompts[0][:150] + prompts[1][:30]
    want = _greedy(model, branch)
    got = restarted.generate(branch, GREEDY)
    assert got.new_token_ids == want
    stats = restarted.stats()["tiers"]
    assert stats["restored_state_files"] == len(files) and stats["restored_states"] >= 1
    if corrupt:
        assert got.cached_tokens == 0
        assert stats["chunk_rejects"].get("state_checksum", 0) >= 1, stats["chunk_rejects"]
    else:
        assert got.cached_tokens == 128
        # Read from its file, by the queue-driven prefetch or at admission.
        assert stats["state_loads_host"] + stats["state_loads_ssd"] == 1, stats
        assert stats["state_prefetch_started"] + stats["state_loads_ssd"] >= 1, stats
    assert_no_leak(restarted)
    restarted.tiers.assert_invariants()
    restarted.stop()


def test_another_models_state_files_are_left_alone(model, tmp_path):
    """Two models over one SSD directory: the other model's page chunks were left alone but
    its state files were taken for this engine's (no header read), so its slot limit and its
    writes deleted them (11 of 13 in the audit's case)."""
    base = make_engine(model, policy="checkpoint", interval=32, num_checkpoint_slots=3,
                       num_kv_pages=24, max_tokens_per_step=200)

    def engine_of(fingerprint: str, slots: int) -> Engine:
        return Engine(model, replace(base.config, tiers=TierConfig(
            host_pages=4, ssd_path=str(tmp_path / "ssd"), model_fingerprint=fingerprint,
            host_checkpoint_slots=2, ssd_checkpoint_slots=slots)))

    a = engine_of("model-a", 16)
    for seed in range(4):
        a.generate(random_prompt(200, 97, seed=seed), GREEDY)
    a.tiers.drain()
    a.stop()
    states = tmp_path / "ssd" / "states"
    theirs = set(states.iterdir())
    assert len(theirs) > 2
    b = engine_of("model-b", 2)
    assert b.stats()["tiers"]["chunk_rejects"]["state_foreign_model"] == len(theirs)
    for seed in range(10, 12):
        b.generate(random_prompt(200, 97, seed=seed), GREEDY)
    b.tiers.drain()
    assert theirs <= set(states.iterdir())  # every one of A's kept
    assert 0 < len(set(states.iterdir()) - theirs) <= 2  # and B's own within its slots
    b.tiers.assert_invariants()
    b.stop()
    again = engine_of("model-a", 16)
    assert again.stats()["tiers"]["restored_state_files"] == len(theirs)
    again.stop()


def _restarted_over_ssd(model, tmp_path, policy: str, seeds,
                        states: bool | None = None) -> tuple[Engine, list]:
    """An engine with one I/O thread restarted over an SSD tier that holds the prompts of
    `seeds` (with their saved states where `states`, by default under the checkpoint
    policy): (engine, prompts)."""
    states = policy == "checkpoint" if states is None else states
    slots = dict(host_checkpoint_slots=1, ssd_checkpoint_slots=16) if states else {}
    tiers = TierConfig(host_pages=64, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m",
                       ssd_bytes=1 << 30, io_threads=1, **slots)
    base = make_engine(model, policy=policy, num_kv_pages=24, max_tokens_per_step=200,
                       num_checkpoint_slots=3)
    config = replace(base.config, tiers=tiers)
    prompts = _fill_ssd(Engine(model, config), seeds)
    return Engine(model, config), prompts


def _collecting(engine: Engine, outputs: dict):
    """submit(rid, prompt): a greedy request whose tokens and finish reason land in
    outputs[rid] / outputs[rid, "reason"]."""
    def submit(rid, prompt):
        outputs[rid] = []

        def collect(out):
            outputs[rid].extend(out.new_token_ids)
            if out.finished:
                outputs[rid, "reason"] = out.finish_reason
        engine.submit(Request(rid, prompt, GREEDY, on_output=collect))
    return submit


def _one_running(engine: Engine, seed: int):
    """(submit, outputs, other): `_collecting`'s submit after a 100-token request "other"
    was submitted and stepped until it decodes (prefilled: it decodes from here on)."""
    outputs: dict = {}
    submit = _collecting(engine, outputs)
    other = random_prompt(100, 97, seed=seed)
    submit("other", other)
    while not outputs["other"]:
        engine.step()
    return submit, outputs, other


def _hold_disk(engine: Engine) -> threading.Event:
    """Occupies the engine's one I/O thread until the returned event is set."""
    disk = threading.Event()
    engine.tiers.io.submit(Priority.PREFETCH, lambda: disk.wait(30))
    return disk


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_a_request_whose_pages_are_on_ssd_waits_queued_while_others_run(model, tmp_path,
                                                                         policy):
    """PCR's queue-time prefetch: after a restart the branch's pages (and, checkpoint policy,
    its state) are on SSD only. Arriving while another request decodes, with the disk slow
    (its one I/O thread held), it stays queued while its reads wait and that request steps
    on (the engine thread does not wait for the disk); then it is scheduled with every page
    served from DRAM, no SSD read on demand, and decodes what a full prefill decodes."""
    engine, prompts = _restarted_over_ssd(model, tmp_path, policy, range(40, 44))
    submit, outputs, other = _one_running(engine, seed=45)
    disk = _hold_disk(engine)
    branch = prompts[0][:150] + prompts[1][:30]
    submit("branch", branch)
    for _ in range(3):
        before = len(outputs["other"])
        engine.step()
        queued = [s.request_id for s in engine.scheduler.waiting]
        assert queued == ["branch"] and len(outputs["other"]) == before + 1
    disk.set()
    while engine.has_work:
        engine.step()
    stats = engine.stats()["tiers"]
    assert stats["deferred_admissions"] >= 3
    assert stats["prefetch_misses"] == 0 and stats["state_prefetch_misses"] == 0, stats
    assert stats["state_loads_ssd"] == 0, stats
    assert outputs["branch"] == _greedy(model, branch)
    assert outputs["other"] == _greedy(model, other)
    hits = engine.stats()["cache"]["hit_tokens_by_tier"]
    assert hits == {"device": 0, "host": 128 if policy == "checkpoint" else 144, "ssd": 0}
    assert_no_leak(engine)
    engine.tiers.assert_invariants()
    engine.stop()


def test_a_spilled_live_state_is_prefetched_while_its_request_waits(model, tmp_path):
    """Suffix replay restarted over SSD with state slots: a request that matches exactly a
    cached prompt's 192 tokens, arriving while another request runs, has that prompt's live
    state read by the queue-driven prefetch (no read on demand), loads it instead of
    replaying and decodes what a full prefill decodes."""
    engine, prompts = _restarted_over_ssd(model, tmp_path, "suffixreplay", range(40, 44),
                                          states=True)
    submit, outputs, other = _one_running(engine, seed=45)
    branch = prompts[0][:192] + prompts[1][:30]
    submit("branch", branch)
    while engine.has_work:
        engine.step()
    stats = engine.stats()
    tiers = stats["tiers"]
    assert tiers["state_prefetch_started"] >= 1 and tiers["state_prefetch_misses"] == 0, tiers
    assert tiers["state_loads_host"] == 1 and tiers["state_loads_ssd"] == 0, tiers
    assert stats["replayed_anchors"] == 0, stats
    assert outputs["branch"] == _greedy(model, branch)
    assert_no_leak(engine)
    engine.tiers.assert_invariants()
    engine.stop()


def test_a_request_queued_for_its_reads_can_be_cancelled(model, tmp_path):
    """Two branches wait queued for a held disk; one is cancelled there. The other is served
    once the disk frees, the cancelled one's pages stay cached (a later request hits all of
    them), and nothing leaks."""
    engine, prompts = _restarted_over_ssd(model, tmp_path, "suffixreplay", range(60, 64))
    submit, outputs, other = _one_running(engine, seed=65)
    disk = _hold_disk(engine)
    branches = [prompts[0][:150] + prompts[1][:30], prompts[2][:150] + prompts[3][:30]]
    submit("b0", branches[0])
    submit("b1", branches[1])
    for _ in range(2):
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["b0", "b1"]
    engine.cancel("b0")
    engine.step()
    assert outputs["b0", "reason"] == "cancelled" and outputs["b0"] == []
    assert [s.request_id for s in engine.scheduler.waiting] == ["b1"]
    disk.set()
    while engine.has_work:
        engine.step()
    assert outputs["b1"] == _greedy(model, branches[1])
    assert outputs["other"] == _greedy(model, other)
    again = engine.generate(branches[0], GREEDY)
    assert again.cached_tokens == 144 and again.new_token_ids == _greedy(model, branches[0])
    assert_no_leak(engine)
    engine.tiers.assert_invariants()
    engine.stop()


def test_max_cached_pages_keeps_the_device_budget_and_the_rest_serves_from_dram(model):
    base = make_engine(model, num_kv_pages=64, max_tokens_per_step=200)
    cache = replace(base.config.cache, max_cached_pages=2)
    engine = Engine(model, replace(base.config, cache=cache,
                                   tiers=TierConfig(host_pages=64)))
    prompt = random_prompt(200, 97, seed=31)
    engine.generate(prompt, GREEDY)
    assert engine.store.num_idle_device_pages == 2
    branch = prompt[:150] + random_prompt(30, 97, seed=32)
    want = _greedy(model, branch)
    got = engine.generate(branch, GREEDY)
    assert got.new_token_ids == want and got.cached_tokens == 144
    assert engine.stats()["cache"]["hit_tokens_by_tier"]["host"] >= 144 - 2 * 16
    assert engine.store.num_idle_device_pages == 2
    assert_no_leak(engine)
    engine.stop()


def _files_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_state_files_are_paid_from_the_ssd_budget(model, tmp_path):
    """ssd_bytes bounds every file of the SSD tier: the saved states' files (at most
    ssd_checkpoint_slots) are set aside from it and the page chunks get the rest (the state
    files came on top: 2.5 times the budget on disk); a budget they would fill is refused."""
    base = make_engine(model, policy="checkpoint", interval=32, num_checkpoint_slots=3,
                       num_kv_pages=24, max_tokens_per_step=200)
    probe = TierConfig(host_pages=4, ssd_path=str(tmp_path / "probe"), model_fingerprint="m",
                       host_checkpoint_slots=2, ssd_checkpoint_slots=3)
    engine = Engine(model, replace(base.config, tiers=probe))
    chunk, state = engine.tiers.ssd.chunk_bytes, engine.tiers.states.file_bytes
    engine.stop()
    budget = 6 * chunk + 3 * state
    ssd = tmp_path / "ssd"
    engine = Engine(model, replace(base.config, tiers=replace(probe, ssd_path=str(ssd),
                                                              ssd_bytes=budget)))
    assert engine.tiers.ssd.budget_bytes == 6 * chunk
    for seed in range(4):
        engine.generate(random_prompt(200, 97, seed=seed), GREEDY)
    engine.tiers.drain()
    states = list((ssd / "states").iterdir())
    assert 0 < len(states) <= 3 and engine.tiers.ssd.used_bytes > 0
    assert _files_bytes(ssd) <= budget
    assert engine.stats()["memory_bytes"]["ssd"] == _files_bytes(ssd)
    engine.tiers.assert_invariants()
    engine.stop()
    with pytest.raises(ValueError, match="leave nothing of ssd_bytes"):
        Engine(model, replace(base.config, tiers=replace(probe, ssd_path=str(tmp_path / "x"),
                                                         ssd_bytes=3 * state)))


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_memory_bytes_count_the_pools_and_the_files(model, tmp_path, policy):
    """engine.stats()["memory_bytes"]: the device pools' entries in use at their size (a KV
    page from the model's shape, a saved state as large as its SSD payload), DRAM slots in
    use, and exactly what the SSD tier's files hold on disk."""
    states = dict(host_checkpoint_slots=1, ssd_checkpoint_slots=16) if policy == "checkpoint" \
        else {}
    base = make_engine(model, policy=policy, num_kv_pages=24, max_tokens_per_step=200,
                       num_checkpoint_slots=3)
    tiers = TierConfig(host_pages=16, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m",
                       ssd_bytes=1 << 30, **states)
    engine = Engine(model, replace(base.config, tiers=tiers))
    for s in range(30, 34):
        engine.generate(random_prompt(200, 97, seed=s), GREEDY)
    engine.tiers.drain()
    mem, store, cfg = engine.stats()["memory_bytes"], engine.store, model.config
    kv_page = len(cfg.attention_layer_ids) * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert store.kv_pool.num_used > 0 and mem["device_kv"] == store.kv_pool.num_used * kv_page
    host = engine.tiers.host
    assert host.slots.num_used > 0
    assert mem["host"] >= host.slots.num_used * kv_page
    assert mem["ssd"] == _files_bytes(tmp_path / "ssd") > 0
    # Saved states: checkpoints, or suffix replay's live states at prompt ends.
    slot = StateLayout(engine.tiers.buffers.states).nbytes
    assert mem["device_states"] == store.state_pool.num_used * slot > 0
    if policy == "suffixreplay":
        layout = engine.tiers.layout
        assert mem["device_anchors"] == store.anchor_pool.num_used * layout.anchor_bytes > 0
    else:
        assert mem["device_anchors"] == 0
        assert any((tmp_path / "ssd" / "states").iterdir())
    assert_no_leak(engine)
    engine.stop()
