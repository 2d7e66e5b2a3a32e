"""`max_queue_size`: at most that many requests wait for a slot; one more is refused with
`QueueFull` (nothing of it kept), a request that leaves the queue makes room, sequences
submitted past the limit on purpose (a request's later sequences) go in."""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_helpers import GREEDY, assert_no_leak, make_engine, random_prompt

from backend.engine import EngineConfig
from backend.engine.engine import QueueFull
from backend.engine.request import Request
from backend.model import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine_helpers import family_checkpoint

    path = tmp_path_factory.mktemp("queue-qwen3_5")
    family_checkpoint(path, "qwen3_5", seed=5)
    return load_model(path)


def _engine(model, max_queue_size: int, max_num_seqs: int = 1):
    engine = make_engine(model, max_num_seqs=max_num_seqs)
    engine.config = replace(engine.config, max_queue_size=max_queue_size)
    return engine


def _request(i: int, max_tokens: int = 4) -> Request:
    return Request(f"r{i}", random_prompt(40, 97, seed=i), replace(GREEDY, max_tokens=max_tokens))


def _finish(engine) -> None:
    while engine.has_work:
        engine.step()


def test_requests_past_the_limit_are_refused_until_the_queue_drains(model):
    engine = _engine(model, max_queue_size=2)
    engine.submit(_request(0))
    engine.submit(_request(1))
    with pytest.raises(QueueFull, match=r"queue is full \(2 requests wait.*max_queue_size"):
        engine.submit(_request(2))
    assert "r2" not in engine._live  # nothing of a refused request stays
    engine.step()  # r0 takes the one slot, r1 waits: one place left
    assert engine.stats()["waiting_requests"] == 1
    engine.submit(_request(3))
    with pytest.raises(QueueFull):
        engine.submit(_request(4))
    engine.submit(_request(5), over_queue_limit=True)  # past the limit on purpose
    stats = engine.stats()
    assert stats["rejected_requests"] == 2 and stats["max_queue_size"] == 2
    _finish(engine)  # the queue drains: requests are taken again
    engine.submit(_request(2))
    _finish(engine)
    assert engine.stats()["finished_requests"] == 5
    assert_no_leak(engine)


def test_a_refused_request_leaves_the_others_unchanged(model):
    """The requests that were queued produce what they produce without the refusal."""
    alone = _engine(model, max_queue_size=0)
    for i in (0, 1):
        alone.submit(_request(i, max_tokens=6))
    alone_outs = {}
    while alone.has_work:
        for out in alone.step():
            alone_outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine = _engine(model, max_queue_size=2)
    for i in (0, 1):
        engine.submit(_request(i, max_tokens=6))
    with pytest.raises(QueueFull):
        engine.submit(_request(2, max_tokens=6))
    outs = {}
    while engine.has_work:
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert outs == alone_outs and set(outs) == {"r0", "r1"}
    assert_no_leak(engine)


def test_no_limit_by_default_and_a_negative_one_is_refused(model):
    engine = _engine(model, max_queue_size=0)
    for i in range(12):  # 1 slot, 11 waiting
        engine.submit(_request(i))
    _finish(engine)
    assert engine.stats()["rejected_requests"] == 0
    with pytest.raises(ValueError, match="max_queue_size must be >= 0"):
        EngineConfig(max_queue_size=-1)
    assert EngineConfig.from_params({"max_queue_size": "64"}).max_queue_size == 64


def test_a_preempted_request_does_not_fill_the_queue(model):
    """A running request preempted by a more urgent one waits to resume: it is not a new
    request waiting, so the queue's limit does not count it (it made the queue refuse
    requests for the engine's own preemptions)."""
    engine = _engine(model, max_queue_size=1)
    low = _request(0, max_tokens=16)
    engine.submit(replace(low, priority=5))
    engine.step()  # running
    engine.submit(_request(1))  # more urgent: preempts it at the next step
    engine.step()
    assert engine.scheduler.num_preemptions == 1
    assert [s.request.request_id for s in engine.scheduler.waiting] == ["r0"]
    engine.submit(_request(2))  # the queue holds no new request: room for one
    with pytest.raises(QueueFull):
        engine.submit(_request(3))
    _finish(engine)
    assert engine.stats()["finished_requests"] == 3
    assert_no_leak(engine)
