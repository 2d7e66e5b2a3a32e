"""Suffix replay's live states under sessions that take turns (multi-turn chat, several
sessions at once): the state a session's next turn resumes from must outlive the other
sessions' turns while the slots hold one state per session (`PrefixStore.shadow_states`)."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, PAGE, assert_no_leak, make_engine, random_prompt

from backend.cache.radix import encode_tokens
from backend.model import load_model

SESSIONS, TURNS, SLOTS = 4, 4, 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine_helpers import family_checkpoint

    path = tmp_path_factory.mktemp("live-states-qwen3_5")
    family_checkpoint(path, "qwen3_5", seed=5)
    return load_model(path)


def _turns(vocab: int) -> list[tuple[int, list[int]]]:
    """(session, prompt) in the order sent: round-robin by turn, each prompt the session's
    history (its earlier prompts and a reply of its own, as a chat client re-sends a
    dataset's conversation) plus a new user message. Whole pages, so a 12-token output
    ends inside the prompt end's next page (the prompt end is the deepest state)."""
    history = [random_prompt(3 * PAGE, vocab, seed=100 + s) for s in range(SESSIONS)]
    out = []
    for t in range(TURNS):
        for s in range(SESSIONS):
            user = random_prompt(PAGE, vocab, seed=1000 + 10 * s + t)
            prompt = history[s] + user
            out.append((s, prompt))
            history[s] = prompt + random_prompt(PAGE, vocab, seed=2000 + 10 * s + t)
    return out


def _serve(engine, turns):
    return [engine.generate(prompt, GREEDY) for _, prompt in turns]


def test_sessions_taking_turns_resume_from_live_states(model):
    turns = _turns(model.config.vocab_size)
    plain = _serve(make_engine(model, policy="none"), turns)
    engine = make_engine(model, num_checkpoint_slots=SLOTS)
    got = _serve(engine, turns)
    later = got[SESSIONS:]  # every turn after each session's first
    assert [o.replayed_anchors for o in later] == [0] * len(later)
    assert engine.stats()["live_state_hits"] == len(later)
    # Each resumes at the previous prompt's end (its reply and message are new).
    assert all(o.cached_tokens == len(p) - 2 * PAGE for o, (_, p) in zip(later, turns[SESSIONS:],
                                                                     strict=True))
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in plain]
    # What was resumed from went first: each turn shadowed the previous turn's state.
    assert engine.store.stats.shadowed_states == len(later)
    assert_no_leak(engine)


def test_without_shadowing_the_sessions_cycle_through_the_slots(model):
    """Plain LRU over states (the earlier policy): each turn refreshes the state it resumed
    from and saves a new one, two per session for fewer slots than that, so the state a
    session needs next is the least recent when the others have taken their turns."""
    turns = _turns(model.config.vocab_size)
    engine = make_engine(model, num_checkpoint_slots=SLOTS, shadowed_states_first=False)
    got = _serve(engine, turns)
    assert sum(o.replayed_anchors > 0 for o in got[SESSIONS:]) > len(got[SESSIONS:]) // 2
    assert engine.store.stats.shadowed_states == 0
    assert_no_leak(engine)


def test_a_state_several_requests_resume_from_is_not_shadowed(model):
    """A shared document's state (RAG: each question resumes from it, then saves its own
    deeper state) is a branch point: after the second resume it is kept like any recent
    state, not put first in line."""
    vocab = model.config.vocab_size
    doc = random_prompt(4 * PAGE, vocab, seed=7)
    engine = make_engine(model, num_checkpoint_slots=SLOTS)
    engine.generate(doc, GREEDY)  # the document's state at its end
    node = engine.store.tree.walk(encode_tokens(doc), None)[-1]
    for q in range(3):
        out = engine.generate(doc + random_prompt(PAGE, vocab, seed=50 + q), GREEDY)
        assert out.cached_tokens == len(doc) and out.replayed_anchors == 0
    assert node.state_slot is not None and node.state_uses == 3
    assert not node.state_shadowed  # shadowed after the first question, recent again since
    assert engine.store.stats.shadowed_states == 1
    # The shadowing is suffix replay's: the checkpoint baseline's states keep plain LRU.
    ckpt = make_engine(model, policy="checkpoint", num_checkpoint_slots=SLOTS)
    for q in range(3):
        ckpt.generate(doc + random_prompt(PAGE, vocab, seed=50 + q), GREEDY)
    assert ckpt.store.stats.shadowed_states == 0
