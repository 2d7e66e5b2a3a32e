"""Request.deadline (TensorRT-LLM's allotted_time_ms, made absolute): a request still waiting
or running when its deadline passes ends with finish_reason "timed_out", keeping the tokens
it generated (those of a plain run, cut; its pages cached for a retry), a beam search with
its beams so far; nothing stays held. The engine's clock is replaced so the tests decide
when the deadline passes."""

from __future__ import annotations

import time

import pytest
from engine_helpers import PAGE, assert_no_leak, make_engine, random_prompt
from hf_oracle import make_hf_checkpoint

from backend.engine import Request, SamplingParams
from backend.model import load_model

LONG = SamplingParams(max_tokens=120, top_k=1, end_id=-1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("deadline-model")
    make_hf_checkpoint(path, seed=5)
    return make_engine(load_model(path), max_num_seqs=2)


@pytest.fixture
def clock(engine):
    now = [1000.0]
    engine.clock = lambda: now[0]
    yield now
    engine.clock = time.monotonic


def run(engine, requests: list[Request], steps: int | None = None) -> None:
    for request in requests:
        engine.submit(request)
    taken = 0
    while engine.has_work and (steps is None or taken < steps):
        engine.step()
        taken += 1


def test_a_running_request_ends_at_its_deadline_with_what_it_generated(engine, clock):
    prompt = random_prompt(40, engine.model_config.vocab_size, seed=1)
    plain = engine.generate(prompt, LONG).new_token_ids
    before = engine.stats()["timed_out_requests"]
    outs: list = []
    run(engine, [Request("late", prompt, LONG, on_output=outs.append, deadline=1010.0)],
        steps=12)
    assert not any(o.finished for o in outs)
    clock[0] = 1010.0  # the deadline: the next step ends it
    run(engine, [])
    tokens = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].finished and outs[-1].finish_reason == "timed_out"
    assert 5 < len(tokens) < len(plain) and tokens == plain[:len(tokens)]
    assert [o.finished for o in outs].count(True) == 1
    assert engine.stats()["timed_out_requests"] == before + 1
    assert_no_leak(engine)
    # Its computed pages stayed cached: the retry (prompt + what it generated) hits them.
    retry = engine.generate(prompt + tokens, SamplingParams(max_tokens=4, top_k=1, end_id=-1))
    assert retry.cached_tokens >= (len(prompt) + len(tokens) - 1) // PAGE * PAGE > len(prompt)
    assert retry.new_token_ids == plain[len(tokens):len(tokens) + 4]
    assert_no_leak(engine)


def test_a_waiting_request_times_out_before_it_runs(engine, clock):
    """Two slots: the third request waits; its deadline passes while it waits, the others
    run on to their ends."""
    vocab = engine.model_config.vocab_size
    outs: dict[str, list] = {name: [] for name in ("a", "b", "queued")}
    requests = [Request(name, random_prompt(30, vocab, seed=i), LONG,
                        on_output=outs[name].append,
                        deadline=1005.0 if name == "queued" else None)
                for i, name in enumerate(outs)]
    run(engine, requests, steps=3)
    assert outs["queued"] == [] and engine.stats()["waiting_requests"] == 1
    clock[0] = 1006.0
    run(engine, [])
    assert [(o.new_token_ids, o.finish_reason) for o in outs["queued"]] == [([], "timed_out")]
    for name in ("a", "b"):
        assert outs[name][-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs[name]) == LONG.max_tokens
    assert_no_leak(engine)


def test_a_beam_search_times_out_with_its_beams_so_far(engine, clock):
    prompt = random_prompt(24, engine.model_config.vocab_size, seed=7)
    params = SamplingParams(max_tokens=80, beam_width=2, end_id=-1)
    outs: list = []
    run(engine, [Request("beams", prompt, params, on_output=outs.append, deadline=1001.0)],
        steps=10)
    clock[0] = 1002.0
    run(engine, [])
    [final] = outs  # not streamed: one output
    assert final.finished and final.finish_reason == "timed_out"
    beams = final.beams
    assert len(beams) == 2 and all(b.finish_reason == "timed_out" for b in beams)
    lengths = {len(b.token_ids) for b in beams}
    assert len(lengths) == 1 and 3 < lengths.pop() < params.max_tokens
    assert [b.score for b in beams] == sorted((b.score for b in beams), reverse=True)
    assert final.new_token_ids == beams[0].token_ids
    assert_no_leak(engine)


def test_requests_that_finish_in_time_are_not_timed_out(engine, clock):
    """Deadlines of finished requests are forgotten (the engine's list stays bounded) and
    never end a later request of the same id."""
    vocab = engine.model_config.vocab_size
    before = engine.stats()["timed_out_requests"]
    short = SamplingParams(max_tokens=2, top_k=1, end_id=-1)
    for i in range(150):
        run(engine, [Request(f"quick-{i % 3}", random_prompt(8, vocab, seed=i), short,
                             deadline=1000.5 + i)])
        assert len(engine._deadlines) <= 66  # pruned past 64 + 2 per live request
    clock[0] = 2000.0
    outs: list = []
    run(engine, [Request("quick-0", random_prompt(8, vocab, seed=1), short,
                         on_output=outs.append)])
    assert outs[-1].finish_reason == "length"
    assert engine.stats()["timed_out_requests"] == before
    assert_no_leak(engine)


def test_a_numpy_deadline_is_a_number_of_seconds(engine, clock):
    """A deadline read from a tensor (numpy float32 / int64) was refused as not a finite
    time."""
    import numpy as np

    prompt = random_prompt(20, engine.model_config.vocab_size, seed=3)
    for deadline in (np.float32(900.0), np.int64(900)):  # already past
        outs: list = []
        run(engine, [Request(f"np-{deadline!r}", prompt, LONG, on_output=outs.append,
                             deadline=deadline)])
        assert outs[-1].finish_reason == "timed_out"
    assert_no_leak(engine)
