"""Linear states saved in the middle of a prefill step (checkpoints without splitting it)
against the same states from steps that end there."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    GREEDY,
    PAGE,
    assert_no_leak,
    make_engine,
    random_prompt,
)

from backend.engine.executor import TorchExecutor
from backend.model import SeqInput

CHECKPOINT = (23, False)  # seed, slow decay (conftest.family_model)


@pytest.fixture(scope="module")
def model(family_model):
    """Every family of `engine_helpers.FAMILIES`."""
    return family_model


def _executor(model):
    return TorchExecutor(model, num_kv_pages=64, page_size=PAGE, num_run_slots=2,
                         num_saved_slots=8, num_anchor_rows=4)


def _states(ex, slot):
    return [t[slot] for t in ex.saved_states.conv + ex.saved_states.rec]


def test_mid_step_snapshots_equal_states_of_split_steps(model):
    """Row 0 starts fresh (200 tokens), row 1 continues a 64-token prefix (150 tokens): one
    step with snapshots after 64 and 128 new tokens of each row saves what steps ending
    there leave in the run slots, and ends with the same logits and states."""
    V = model.config.vocab_size
    ids = [random_prompt(200, V, seed=1), random_prompt(214, V, seed=2)]
    tables = [torch.arange(0, 16), torch.arange(16, 32)]
    one, split = _executor(model), _executor(model)
    for ex in (one, split):  # row 1's prefix
        ex.forward([SeqInput(ids[1][:64], 0, tables[1], 1)])
    snaps = [(0, 64, 0), (0, 128, 1), (1, 64, 2), (1, 128, 3)]
    logits = one.forward([SeqInput(ids[0], 0, tables[0], 0),
                          SeqInput(ids[1][64:], 64, tables[1], 1)], snapshots=snaps)
    bounds = {0: [0, 64, 128, 200], 1: [64, 128, 192, 214]}
    for b in (0, 1):
        for i, (start, end) in enumerate(zip(bounds[b], bounds[b][1:])):
            last = split.forward([SeqInput(ids[b][start:end], start, tables[b], b)])
            if i < 2:
                split.save_state(b, 2 * b + i)
        torch.testing.assert_close(logits[b], last[0], atol=1e-4, rtol=1e-4)
    for slot in range(4):
        for got, want in zip(_states(one, slot), _states(split, slot)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert any(t.abs().sum() > 0 for t in _states(one, slot))
    for got, want in zip(one.run_states.conv + one.run_states.rec,
                         split.run_states.conv + split.run_states.rec):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_snapshot_offsets_must_be_chunk_aligned(model):
    ex = _executor(model)
    ids = random_prompt(100, model.config.vocab_size, seed=3)
    with pytest.raises(ValueError, match="multiples of 64"):
        ex.forward([SeqInput(ids, 0, torch.arange(0, 16), 0)], snapshots=[(0, 32, 0)])


def test_checkpoint_policy_saves_its_grid_in_one_step(model, monkeypatch):
    """The checkpoint baseline's prompt of 300 tokens (checkpoints every 64 and at the last
    page boundary, 288) prefills in two steps, not six: 64..256 are saved mid-step; 288,
    32 tokens past a 64-token chunk boundary, still ends a step (pages of 16 tokens here;
    with the default 64-token pages every page boundary is a chunk boundary). Resuming at
    each checkpoint gives what the split prefill gives."""
    V = model.config.vocab_size
    prompt = random_prompt(300, V, seed=5)
    branches = [prompt[:at] + random_prompt(20, V, seed=at) for at in (70, 130, 200, 290)]

    def run(engine):
        engine.generate(prompt, GREEDY)
        steps = engine.scheduler.num_steps
        outs = [engine.generate(b, GREEDY) for b in branches]
        assert_no_leak(engine)
        return steps, [(o.new_token_ids, o.cached_tokens) for o in outs]

    one_step = run(make_engine(model, policy="checkpoint", interval=64,
                               max_tokens_per_step=512))
    monkeypatch.setattr(TorchExecutor, "supports_snapshots", False)
    split = run(make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=512))
    assert one_step[1] == split[1]
    assert [c for _, c in one_step[1]] == [64, 128, 192, 288]
    assert one_step[0] == split[0] - 4  # 2 + 11 decode steps, against 6 + 11


def test_snapshots_in_batches_with_decodes_keep_outputs_and_states(model):
    """Concurrent prompts under the checkpoint policy: steps mix decode rows with prefill
    rows that save checkpoints mid-step; every output equals plain greedy decoding, and each
    prompt's checkpoints serve later branches with plain greedy's tokens."""
    from backend.engine import Request
    from backend.model.generate import greedy_generate

    V = model.config.vocab_size
    prompts = [random_prompt(n, V, seed=60 + n) for n in (40, 200, 330, 260)]
    engine = make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=400)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", p, GREEDY, on_output=lambda o: outs.setdefault(
            o.request_id, []).extend(o.new_token_ids)))
    while engine.has_work:
        engine.step()
    want = greedy_generate(model, prompts, max_new_tokens=12, page_size=PAGE)
    assert [outs[f"r{i}"] for i in range(4)] == want
    branches = [prompts[1][:140] + [1, 2, 3], prompts[2][:300] + [4, 5], prompts[3][:70]]
    got = [engine.generate(b, GREEDY) for b in branches]
    assert [g.new_token_ids for g in got] == greedy_generate(model, branches, 12, PAGE)
    assert [g.cached_tokens for g in got] == [128, 256, 64]
    assert_no_leak(engine)


def _prefill_steps(engine, prompt):
    """Steps until the prompt's first token, and the engine (prompt cached)."""
    from backend.engine import Request

    first = []
    engine.submit(Request("p", prompt, GREEDY, on_output=lambda o: first.append(
        engine.scheduler.num_steps) if o.new_token_ids and not first else None))
    while engine.has_work:
        engine.step()
    return first[0]


def test_budget_cut_chunks_end_on_a_chunk_boundary_before_planned_states(model):
    """Checkpoints every 64 tokens (pages of 16), a 300-token step budget, a 700-token
    prompt: chunks [0, 256), [256, 512), [512, 688), [688, 700), each saving its checkpoints
    mid-step (688, the last page boundary, is off the delta rule's 64-token chunk grid and
    ends a step). Cut at the budget ([0, 300), ...) the chunks after the first would start
    off that grid and end at the next checkpoint: six steps, two of 20 tokens."""
    from backend.model.generate import greedy_generate

    V = model.config.vocab_size
    prompt = random_prompt(700, V, seed=31)
    engine = make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=300)
    assert _prefill_steps(engine, prompt) == 4
    branches = [prompt[:at] + random_prompt(9, V, seed=at) for at in (200, 330, 650)]
    got = [engine.generate(b, GREEDY) for b in branches]
    assert [g.cached_tokens for g in got] == [192, 320, 640]
    assert [g.new_token_ids for g in got] == greedy_generate(model, branches, 12, PAGE)
    assert_no_leak(engine)
    # a short budget-cut chunk is not shortened (it would lose too much of the step)
    engine = make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=100)
    steps = _prefill_steps(engine, prompt)
    assert steps > 7  # 100-token chunks, cut short at unaligned checkpoints
    assert_no_leak(engine)


def test_a_step_is_not_cut_for_a_checkpoint_without_a_free_slot(model):
    """Two checkpoint slots, checkpoints every 64 tokens: a 300-token prompt prefills in two
    steps (the second from 288, its last page boundary) as with plenty of slots: the
    checkpoints that find no slot are not kept, the step goes on. Over several steps a
    prompt gives up its shallowest earlier states for deeper ones. Every hit resumes with
    plain greedy's tokens."""
    from backend.model.generate import greedy_generate

    V = model.config.vocab_size
    prompt = random_prompt(300, V, seed=41)
    plenty = make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=512)
    scarce = make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=512,
                         num_checkpoint_slots=2)
    assert _prefill_steps(scarce, prompt) == _prefill_steps(plenty, prompt) == 2
    long = random_prompt(600, V, seed=42)
    scarce = make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=256,
                         num_checkpoint_slots=2)
    _prefill_steps(scarce, long)
    branches = [long[:at] + random_prompt(7, V, seed=at) for at in (595, 100)]
    got = [scarce.generate(b, GREEDY) for b in branches]
    assert [g.new_token_ids for g in got] == greedy_generate(model, branches, 12, PAGE)
    assert got[0].cached_tokens == 592  # the deepest states were kept
    assert got[1].cached_tokens == 0  # the shallow ones were given up
    assert_no_leak(scarce)


@pytest.mark.parametrize("policy", ["checkpoint", "suffixreplay"])
def test_no_checkpoint_slots_keeps_no_states_and_serves_every_prompt(model, policy):
    """`num_checkpoint_slots=0` (a pool of no saved states): suffix replay serves prompts
    longer than a page with greedy's tokens and still resumes from its anchors; the
    checkpoint policy could resume nothing (a cache that never hit): a config error."""
    from backend.model.generate import greedy_generate

    if policy == "checkpoint":
        with pytest.raises(ValueError, match="num_checkpoint_slots: it must be >= 1"):
            make_engine(model, policy=policy, interval=64, num_checkpoint_slots=0)
        return
    V = model.config.vocab_size
    prompt = random_prompt(200, V, seed=43)
    branches = [prompt + random_prompt(9, V, seed=44), prompt[:150] + random_prompt(5, V, seed=45)]
    engine = make_engine(model, policy=policy, interval=64, num_checkpoint_slots=0)
    first = engine.generate(prompt, GREEDY)
    got = [engine.generate(b, GREEDY) for b in branches]
    want = greedy_generate(model, [prompt] + branches, 12, PAGE)
    assert [first.new_token_ids] + [g.new_token_ids for g in got] == want
    hits = [g.cached_tokens for g in got]
    assert hits == [192, 144]
    assert engine.store.state_pool.capacity == 0
    assert_no_leak(engine)
