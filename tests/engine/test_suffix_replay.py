"""SuffixReplay through the engine: exact mode, budgeted replay against a slow reference,
packed replay, live state, branches between checkpoints; on every family (conftest.family_model)."""

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

from backend.model.generate import PagedSession, greedy_generate
from backend.replay.anchors import AnchorLayout
from backend.replay.budget import ReplayConfig

CHECKPOINT = (21, True)  # seed, slow decay (conftest.family_model)


@pytest.fixture(scope="module")
def model(family_model):
    """Every family of `engine_helpers.FAMILIES`."""
    return family_model


@pytest.fixture(scope="module")
def prompt(model):
    return random_prompt(300, model.config.vocab_size, seed=9)


def _branch(prompt, at):
    return prompt[:at] + [(t + 1) % 97 for t in prompt[at:at + 40]]


def test_exact_mode_equals_no_cache(model, prompt):
    plain = make_engine(model, policy="none")
    exact = make_engine(model, replay=ReplayConfig.exact())
    exact.generate(prompt, GREEDY)  # fills the cache
    for at in (250, 100, 17):
        want = plain.generate(_branch(prompt, at), GREEDY, return_first_logits=True)
        got = exact.generate(_branch(prompt, at), GREEDY, return_first_logits=True)
        assert got.cached_tokens == at // PAGE * PAGE > 0
        assert got.replayed_anchors == got.cached_tokens
        assert got.new_token_ids == want.new_token_ids
        torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)
    assert_no_leak(exact)


def test_budgeted_replay_equals_slow_reference(model, prompt):
    replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8, live_state=False)
    engine = make_engine(model, replay=replay)
    engine.generate(prompt, GREEDY)
    branch = _branch(prompt, 130)
    got = engine.generate(branch, GREEDY, return_first_logits=True)
    assert (got.cached_tokens, got.replayed_anchors) == (128, 8)

    # Reference, the slow way: full prefill for KV; states from replaying the 8 anchors
    # (dense tail: last 4 tokens of pages 6 and 7) captured from a plain prefill.
    layout = AnchorLayout(PAGE, 4)
    positions = torch.cat([p * PAGE + layout.offsets for p in (6, 7)])
    hidden = model.capture_hidden(torch.tensor([prompt[:128]]), positions.unsqueeze(0))
    session = PagedSession(model, batch_size=1, max_tokens=len(branch), page_size=PAGE)
    session.step([branch[:128]])
    cfg = model.config
    for g, layers in enumerate(cfg.group_state_layers):
        for layer_id, (conv, rec) in zip(layers, model.replay_group(g, hidden[g])):
            li = cfg.linear_layer_ids.index(layer_id)
            session.states.conv[li][0] = conv[0]
            session.states.rec[li][0] = rec[0]
    want = session.step([branch[128:]])[0]
    torch.testing.assert_close(got.first_logits, want, atol=1e-5, rtol=1e-5)
    # Replay is an approximation here: it must differ from the exact state.
    exact = make_engine(model, policy="none").generate(branch, GREEDY, return_first_logits=True)
    assert (got.first_logits - exact.first_logits).abs().max() > 1e-3


@pytest.mark.parametrize("cheap_replay", [False, True])
def test_near_live_state_is_resumed_instead_of_replaying(model, prompt, cheap_replay):
    """A branch a page past an earlier prompt's end: with the default cost model the engine
    resumes from that prompt's live state (exact) and recomputes the 16 tokens between; with
    replay priced at nothing it replays at the match end."""
    costs = dict(replay_fixed_tokens=0.0, replay_anchor_tokens=0.0) if cheap_replay else {}
    replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8, **costs)
    engine = make_engine(model, replay=replay)
    plain = make_engine(model, policy="none")
    engine.generate(prompt[:40], GREEDY)  # live state at 32 (its last page boundary)
    engine.generate(prompt, GREEDY)  # pages to 288 through 32, live state at 288
    branch = _branch(prompt, 50)  # matches 48 tokens: pages 0-2
    got = engine.generate(branch, GREEDY, return_first_logits=True)
    want = plain.generate(branch, GREEDY, return_first_logits=True)
    if cheap_replay:
        assert (got.cached_tokens, got.replayed_anchors) == (48, 8)
        assert (got.first_logits - want.first_logits).abs().max() > 1e-3  # approximate
    else:
        assert (got.cached_tokens, got.replayed_anchors) == (32, 0)
        torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=1e-4)
        assert got.new_token_ids == want.new_token_ids
    assert_no_leak(engine)
    # The branch's own pages joined the tree beside the cached ones (no duplicates kept).
    assert engine.store.match_prefix(branch[:-1]).num_matched_pages == (len(branch) - 1) // PAGE


def test_packed_replay_equals_one_by_one(model, prompt):
    engine = make_engine(model)
    engine.generate(prompt, GREEDY)
    ex, layout = engine.executor, engine.cache.layout
    blocks = [n.anchor_block for n in engine.store.match_prefix(prompt).nodes]
    rows = [layout.last_rows(blocks[:n], k) for n, k in ((18, 8), (5, 3), (9, 8))]
    ex.replay([0, 1, 2], rows)
    together = [s.clone() for s in ex.run_states.rec + ex.run_states.conv]
    for slot, r in enumerate(rows):
        ex.reset_state(slot)
        ex.replay([slot], [r])
    for a, b in zip(together, ex.run_states.rec + ex.run_states.conv):
        torch.testing.assert_close(a[:3], b[:3], atol=1e-5, rtol=1e-5)


def test_live_state_and_replay_agree_in_exact_mode(model, prompt):
    results = []
    for live in (True, False):
        replay = ReplayConfig(anchor_density=1.0, budget_fraction=1.0, k_max=None, live_state=live)
        engine = make_engine(model, replay=replay)
        first = engine.generate(prompt[:200], GREEDY)
        follow_up = prompt[:200] + first.new_token_ids + prompt[200:260]
        out = engine.generate(follow_up, GREEDY, return_first_logits=True)
        assert engine.stats()["live_state_hits"] == (1 if live else 0)
        assert out.cached_tokens == (200 + 11) // PAGE * PAGE
        results.append(out)
        assert_no_leak(engine)
    assert results[0].new_token_ids == results[1].new_token_ids
    assert results[0].replayed_anchors == 0 and results[1].replayed_anchors > 0
    torch.testing.assert_close(results[0].first_logits, results[1].first_logits,
                               atol=1e-4, rtol=1e-4)


def test_the_next_sibling_of_a_branch_point_loads_the_replayed_state(model, prompt):
    """Two branches off the cached prompt at the same page (siblings of one branch point,
    as in a tool-call tree): the first replays, the second loads the state that replay
    rebuilt (kept as the match end's live state) and computes what a replay gives."""
    replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8)
    engine, fresh = make_engine(model, replay=replay), make_engine(model, replay=replay)
    for e in (engine, fresh):
        e.generate(prompt, GREEDY)
    first = engine.generate(_branch(prompt, 140), GREEDY)
    sibling = prompt[:140] + [(t + 5) % 97 for t in prompt[140:170]]
    got = engine.generate(sibling, GREEDY, return_first_logits=True)
    want = fresh.generate(sibling, GREEDY, return_first_logits=True)  # replays
    assert first.cached_tokens == got.cached_tokens == want.cached_tokens == 128
    assert first.replayed_anchors == want.replayed_anchors == 8
    assert got.replayed_anchors == 0 and engine.stats()["live_state_hits"] == 1
    assert got.new_token_ids == want.new_token_ids
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-6, rtol=1e-6)
    assert_no_leak(engine)


def test_branch_between_checkpoints_hits_only_under_suffix_replay(model, prompt):
    branch = _branch(prompt, 170)  # page boundary 160 is not a multiple of the interval 64
    hits = {}
    for policy in ("suffixreplay", "checkpoint"):
        engine = make_engine(model, policy=policy, interval=64)
        engine.generate(prompt, GREEDY)
        hits[policy] = engine.generate(branch, GREEDY).cached_tokens
        assert_no_leak(engine)
    assert hits == {"suffixreplay": 160, "checkpoint": 128}


def test_concurrent_requests_match_sequential_greedy(model, prompt):
    # Exact replay: the requests that wait for a running prefill of their prefix resume from
    # its pages by a replay (`share_running_prefills`), which a budget would approximate.
    engine = make_engine(model, replay=ReplayConfig.exact(), max_tokens_per_step=48,
                         num_kv_pages=64)
    prompts = [prompt[:n] for n in (40, 130, 300)] + [_branch(prompt, 70)]
    want = greedy_generate(model, prompts, max_new_tokens=12, page_size=PAGE)
    outs = {}
    from backend.engine import Request

    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", p, GREEDY, on_output=lambda o: outs.setdefault(
            o.request_id, []).extend(o.new_token_ids)))
    while engine.has_work:
        engine.step()
    assert [outs[f"r{i}"] for i in range(4)] == want
    assert_no_leak(engine)


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_a_running_prefill_shares_its_finished_pages(model, prompt, policy):
    """The whole pages of a prompt's earlier prefill chunks are in the store before the
    prompt ends: a request admitted meanwhile hits them (suffix replay; the checkpoint
    baseline has no state there yet and misses), and every output equals plain greedy."""
    from backend.engine import Request

    engine = make_engine(model, policy=policy, max_tokens_per_step=96, interval=256,
                         replay=ReplayConfig.exact())  # exact states: outputs comparable
    branch = _branch(prompt, 170)
    outs: dict[str, list] = {}

    def collect(o):
        outs.setdefault(o.request_id, []).append(o)

    engine.submit(Request("a", prompt, GREEDY, on_output=collect))
    engine.step()
    engine.step()  # "a" has computed [0, 192): 12 whole pages
    assert engine.store.num_cached_pages == 192 // PAGE
    engine.store.assert_invariants()
    engine.submit(Request("b", branch, GREEDY, on_output=collect))
    while engine.has_work:
        engine.step()
    want = greedy_generate(model, [prompt, branch], max_new_tokens=12, page_size=PAGE)
    got = {rid: sum((o.new_token_ids for o in v), []) for rid, v in outs.items()}
    assert [got["a"], got["b"]] == want
    assert outs["b"][-1].cached_tokens == (160 if policy == "suffixreplay" else 0)
    assert_no_leak(engine)


def test_checkpoints_of_a_chunked_prompt_join_the_store(model, prompt):
    """Prefill chunks save the checkpoints they cross (mid-step, or by ending there) and
    insert their pages as they go; the states still join at the prompt's end, also when no
    page is left to insert then (two output tokens do not reach the next page boundary)."""
    from backend.engine import SamplingParams

    engine = make_engine(model, policy="checkpoint", interval=64, max_tokens_per_step=96)
    short = SamplingParams(max_tokens=2, top_k=1)
    engine.generate(prompt, short)  # 300 tokens: checkpoints at 64..256 and 288
    assert engine.generate(prompt[:280] + [1, 2, 3], short).cached_tokens == 256
    assert engine.generate(prompt + [1, 2, 3], short).cached_tokens == 288
    assert_no_leak(engine)


def test_preemption_under_page_pressure_keeps_outputs(model, prompt):
    """40 pages cannot hold four 300-token sequences at once: some must be preempted, and
    they resume with the outputs they would have had. Replay is exact here: with budgeted
    replay a resumed request may take replayed (approximate) states, which on the slow-decay
    Nemotron-H model flips a near tie late in one output (seen), whatever preemption does."""
    engine = make_engine(model, num_kv_pages=40, max_tokens_per_step=320,
                         replay=ReplayConfig.exact())
    prompts = [_branch(prompt, at) for at in (20, 90, 150, 230)]
    want = greedy_generate(model, prompts, max_new_tokens=60, page_size=PAGE)
    from backend.engine import Request, SamplingParams

    outs = {}
    params = SamplingParams(max_tokens=60, top_k=1)
    for i, p in enumerate(prompts):
        engine.submit(Request(f"p{i}", p, params, on_output=lambda o: outs.setdefault(
            o.request_id, []).extend(o.new_token_ids)))
    while engine.has_work:
        engine.step()
    assert engine.stats()["preemptions"] > 0
    assert [outs[f"p{i}"] for i in range(4)] == want
    assert_no_leak(engine)


def test_cancel_releases_pages(model, prompt):
    engine = make_engine(model)
    from backend.engine import Request, SamplingParams

    engine.submit(Request("c", prompt, SamplingParams(max_tokens=50, top_k=1)))
    for _ in range(6):
        engine.step()
    assert engine.stats()["kv_pages_held_by_requests"] > 0
    engine.cancel("c")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("c", "cancelled")]
    stats = engine.stats()
    assert (stats["cancelled_requests"], stats["finished_requests"]) == (1, 0)
    engine.cancel("c")  # no longer open: nothing more to count
    engine.step()
    assert engine.stats()["cancelled_requests"] == 1
    assert_no_leak(engine)


def test_a_failed_step_fails_its_requests_not_the_engine(model, prompt, monkeypatch):
    from backend.engine import Request, SamplingParams

    engine = make_engine(model)
    engine.submit(Request("f", prompt, SamplingParams(max_tokens=20, top_k=1)))
    engine.step()
    real = engine.executor.forward

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.executor, "forward", broken)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("f", "error")]
    assert "simulated kernel failure" in outs[0].error
    assert engine.stats()["failed_requests"] == 1
    monkeypatch.setattr(engine.executor, "forward", real)
    res = engine.generate(prompt[:100], SamplingParams(max_tokens=3, top_k=1))
    assert res.finish_reason == "length" and len(res.new_token_ids) == 3
    stats = engine.stats()
    assert (stats["failed_requests"], stats["finished_requests"]) == (1, 1)
    assert_no_leak(engine)


def test_int8_anchors_replay_close_to_model_dtype_anchors(model, prompt):
    outs = {}
    for dtype in ("model", "int8"):
        replay = ReplayConfig(anchor_density=1.0, budget_fraction=1.0, k_max=None,
                              anchor_dtype=dtype, live_state=False)
        engine = make_engine(model, replay=replay)
        engine.generate(prompt, GREEDY)
        outs[dtype] = engine.generate(_branch(prompt, 200), GREEDY, return_first_logits=True)
        assert outs[dtype].replayed_anchors == 192
        assert engine.executor.anchors.dtype == (torch.int8 if dtype == "int8" else model.dtype)
    diff = (outs["int8"].first_logits - outs["model"].first_logits).abs().max()
    scale = outs["model"].first_logits.abs().max()
    assert 0 < diff < 0.05 * scale


def test_checkpoint_baseline_keeps_the_deepest_states_of_a_long_prompt(model):
    """With fewer checkpoint slots than checkpoints, a prompt keeps its deepest ones."""
    engine = make_engine(model, policy="checkpoint", interval=2 * PAGE, num_checkpoint_slots=3)
    prompt = random_prompt(13 * PAGE, model.config.vocab_size, seed=41)
    engine.generate(prompt, GREEDY)
    again = engine.generate(prompt + random_prompt(5, model.config.vocab_size, seed=42), GREEDY)
    assert again.cached_tokens >= 10 * PAGE
    assert_no_leak(engine)


def test_sglang_placement_resumes_where_sglang_keeps_states(model, prompt):
    """SGLang's placement (extra buffer): one state per prefill chunk, at the prompt's last
    page when nothing branches; a prompt that diverges inside the cached prefix resumes at
    the deepest earlier state and saves one at its branch point instead, which the next
    sibling resumes from; decode keeps states at multiples of the track interval only."""
    from backend.engine import SamplingParams

    assert PAGE == 16  # the positions below are page boundaries
    engine = make_engine(model, policy="checkpoint", interval=64,
                         checkpoint_placement="sglang", checkpoint_prefill_chunk=8192)
    grid = make_engine(model, policy="checkpoint", interval=64)
    for e in (engine, grid):
        e.generate(prompt, GREEDY)  # 300 tokens: states at 288 (sglang); 64..256, 288 (grid)
    first = _branch(prompt, 200)
    assert grid.generate(first, GREEDY).cached_tokens == 192
    assert engine.generate(first, GREEDY).cached_tokens == 0  # no state before 288
    # The first sibling saved one at its branch point (192: the KV it matched); the next
    # sibling resumes there.
    second = prompt[:200] + [(t + 3) % 97 for t in prompt[200:240]]
    assert engine.generate(second, GREEDY).cached_tokens == 192
    assert engine.generate(prompt + [5, 6, 7], GREEDY).cached_tokens == 288
    # Decode of 150 tokens after a 330-token prompt: states at 384, then 448 (multiples of
    # the interval; the latest stays), none at the page boundary 464 (the grid's latest;
    # the last token sampled has no KV yet).
    long = SamplingParams(max_tokens=150, min_tokens=150, top_k=1)
    fresh = random_prompt(330, model.config.vocab_size, seed=13)
    for e, want in ((engine, 448), (grid, 464)):
        out = e.generate(fresh, long)
        assert e.generate(fresh + out.new_token_ids + [1], GREEDY).cached_tokens == want
        assert_no_leak(e)
