"""A queued request whose prompt a running request is prefilling waits for those pages to join
the store (`share_running_prefills`) instead of computing them a second time beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_helpers import PAGE, assert_no_leak, make_engine, random_prompt
from hf_oracle import make_hf_checkpoint

from backend.cache.radix import TOKEN_BYTES, encode_tokens
from backend.engine import Engine, SamplingParams
from backend.engine.request import Request
from backend.engine.scheduler import MAX_PREFILL_WAITS, common_pages
from backend.model import load_model
from backend.model.generate import greedy_generate
from backend.replay.budget import ReplayConfig

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, top_k=1, end_id=-1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharing-model")
    make_hf_checkpoint(path, seed=5)
    return load_model(path)


def _engine(model, share=True, **options) -> Engine:
    # Exact replay: a request that resumes from shared pages equals plain greedy decoding.
    base = make_engine(model, replay=ReplayConfig.exact(), **options)
    return Engine(model, replace(base.config, share_running_prefills=share))


def _serve(engine: Engine, prompts: dict[str, list[int]], salts: dict | None = None,
           cancel: str | None = None) -> dict:
    """Submits every prompt at once and steps to the end (cancelling `cancel` after the first
    step). Returns {rid: (tokens, cached_tokens)}."""
    results: dict = {}

    def collector(rid):
        results[rid] = ([], None)

        def collect(out):
            results[rid][0].extend(out.new_token_ids)
            if out.finished:
                results[rid] = (results[rid][0], out.cached_tokens)
        return collect

    for rid, prompt in prompts.items():
        salt = (salts or {}).get(rid)
        engine.submit(Request(rid, prompt, GREEDY, on_output=collector(rid), cache_salt=salt))
    engine.step()
    if cancel is not None:
        engine.cancel(cancel)
    while engine.has_work:
        engine.step()
    return results


def _reference(model, prompt):
    return greedy_generate(model, [prompt], max_new_tokens=MAX_TOKENS, page_size=PAGE)[0]


def _prompts(model, shared: int, suffixes: tuple[int, ...], seed: int) -> dict:
    vocab = model.config.vocab_size
    common = random_prompt(shared, vocab, seed=seed)
    return {f"r{i}": common + random_prompt(n, vocab, seed=seed + 1 + i)
            for i, n in enumerate(suffixes)}


def test_common_pages_counts_whole_shared_pages():
    page = 4 * TOKEN_BYTES
    a = encode_tokens(list(range(30)))
    assert common_pages(a, a, page) == 7
    assert common_pages(a, encode_tokens(list(range(17)) + [99] * 13), page) == 4
    assert common_pages(a, encode_tokens([5] + list(range(1, 30))), page) == 0
    assert common_pages(a, b"", page) == 0


def test_a_queued_prompt_resumes_from_the_pages_a_running_prefill_computes(model):
    # 3 prompt steps of 96 tokens for the first request: the second waits for its 4 shared
    # pages (16 tokens each) and then recomputes only its own suffix.
    prompts = _prompts(model, shared=72, suffixes=(200, 30), seed=20)
    engine = _engine(model)
    got = _serve(engine, prompts)
    stats = engine.stats()
    assert stats["prefill_waits"] >= 1
    assert got["r1"][1] == 64  # the 4 whole shared pages
    for rid, prompt in prompts.items():
        assert got[rid][0] == _reference(model, prompt)
    assert stats["recomputed_tokens"] == sum(map(len, prompts.values())) - 64
    assert_no_leak(engine)

    # The same burst without sharing computes the common part twice.
    engine = _engine(model, share=False)
    off = _serve(engine, prompts)
    assert engine.stats()["prefill_waits"] == 0 and off["r1"][1] == 0
    assert engine.stats()["recomputed_tokens"] == sum(map(len, prompts.values()))
    assert {rid: toks for rid, (toks, _) in off.items()} == \
        {rid: toks for rid, (toks, _) in got.items()}


def test_a_burst_of_the_same_prompt_prefills_it_once(model):
    prompt = random_prompt(150, model.config.vocab_size, seed=30)
    prompts = {f"r{i}": list(prompt) for i in range(4)}
    engine = _engine(model, max_tokens_per_step=64)
    got = _serve(engine, prompts)
    want = _reference(model, prompt)
    assert all(toks == want for toks, _ in got.values())
    # Steps of 64 tokens: the others wait for the first one's first 8 pages, then run beside
    # its last step (one more page would not be worth waiting another step).
    assert sorted(cached for _, cached in got.values()) == [0, 128, 128, 128]
    assert engine.stats()["recomputed_tokens"] == 150 + 3 * 22
    assert_no_leak(engine)


@pytest.mark.parametrize("case", ["checkpoint", "salt", "one_shared_page"])
def test_no_wait_where_nothing_would_be_shared(model, case):
    # The checkpoint policy's states join at the prompt's end; another cache_salt is another
    # namespace; a single shared page is not worth a step.
    shared = 20 if case == "one_shared_page" else 100
    prompts = _prompts(model, shared=shared, suffixes=(150, 20), seed=40)
    options = {"policy": "checkpoint"} if case == "checkpoint" else {}
    engine = _engine(model, **options)
    salts = {"r1": "tenant-b"} if case == "salt" else None
    got = _serve(engine, prompts, salts)
    assert engine.stats()["prefill_waits"] == 0
    for rid, prompt in prompts.items():
        assert got[rid][0] == _reference(model, prompt)
    assert_no_leak(engine)


def test_cancelling_the_running_prefill_releases_the_waiting_request(model):
    prompts = _prompts(model, shared=300, suffixes=(100, 20), seed=50)
    engine = _engine(model, max_tokens_per_step=64)
    got = _serve(engine, prompts, cancel="r0")
    assert engine.stats()["prefill_waits"] >= 1
    assert got["r1"][0] == _reference(model, prompts["r1"])
    assert got["r1"][1] == 64  # the page the cancelled request computed in its first step
    assert_no_leak(engine)


def test_the_wait_is_bounded(model, monkeypatch):
    # Past MAX_PREFILL_WAITS steps a queued request runs beside the prefill it waits for.
    monkeypatch.setattr("backend.engine.scheduler.MAX_PREFILL_WAITS", 2)
    assert MAX_PREFILL_WAITS > 2
    prompts = _prompts(model, shared=400, suffixes=(30, 10), seed=60)
    engine = _engine(model, max_tokens_per_step=32)
    got = _serve(engine, prompts)
    assert engine.stats()["prefill_waits"] == 2
    assert 0 < got["r1"][1] < 400
    for rid, prompt in prompts.items():
        assert got[rid][0] == _reference(model, prompt)
    assert_no_leak(engine)
