"""Suffix decoding (`speculative_method: suffix`, `SuffixCorpus`): the corpus's counts against
a recount of the requests it holds (as they come and as the oldest go); drafts follow the
most frequent continuation of the longest context; namespaces stay apart; in the engine, a
request that repeats an earlier one's output is drafted from it, and every output equals a
token a step's (greedy, seeded sampling, beside other requests)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from engine_helpers import TINY_MODEL_DIR, assert_no_leak

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request
from backend.engine.speculative import MIN_SUFFIX_SHARE, NgramDrafter, SuffixCorpus

SPEC = dict(num_speculative_tokens=6, prompt_lookup_min=2, prompt_lookup_max=6,
            speculative_adaptive=False)


def recount(requests: list[tuple[str, list[int]]], min_n: int, max_n: int) -> dict:
    counts: dict = {}
    for namespace, tokens in requests:
        for m in range(min_n, max_n + 1):
            for i in range(m, len(tokens)):
                counts.setdefault((namespace, tuple(tokens[i - m:i])), Counter())[tokens[i]] += 1
    return {k: dict(v) for k, v in counts.items()}


def test_counts_are_a_recount_of_the_requests_held():
    rng = random.Random(0)
    corpus = SuffixCorpus(2, 4, max_tokens=120)
    for step in range(60):
        namespace = rng.choice(["", "tenant-a"])
        corpus.add(namespace, [rng.randrange(5) for _ in range(rng.randint(1, 30))])
        assert corpus.num_tokens <= 120
        assert corpus.num_tokens == sum(len(t) for _, t in corpus.requests)
        assert corpus.counts == recount(list(corpus.requests), 2, 4), step
    assert len(corpus.requests) < 60  # the oldest went
    corpus.forget({"tenant-a"})
    assert {n for n, _ in corpus.requests} <= {""}
    assert corpus.counts == recount(list(corpus.requests), 2, 4)
    assert corpus.num_tokens == sum(len(t) for _, t in corpus.requests)
    corpus.forget()
    assert corpus.counts == {} and corpus.num_tokens == 0 and not corpus.requests
    with pytest.raises(ValueError, match="min_n <= max_n"):
        SuffixCorpus(3, 2, 10)


def test_drafts_follow_the_most_frequent_continuation_of_the_longest_context():
    corpus = SuffixCorpus(2, 4, max_tokens=1000)
    corpus.add("", [1, 2, 3, 4, 5, 6])
    corpus.add("", [9, 2, 3, 7, 8])
    corpus.add("", [9, 2, 3, 7, 8])
    # After (2, 3) came 4 once and 7 twice; after (1, 2, 3), only 4: the longer context wins.
    assert corpus.lookup("", [0, 2, 3], 3) == ([7, 8], 2)
    assert corpus.lookup("", [1, 2, 3], 5) == ([4, 5, 6], 3)
    assert corpus.lookup("", [0, 0, 5], 3) == ([], 0)  # no context of min_n tokens
    assert corpus.lookup("", [0, 2, 3], 1) == ([7], 2)
    assert corpus.lookup("other", [1, 2, 3], 5) == ([], 0)  # another namespace's
    rare = SuffixCorpus(1, 1, max_tokens=1000)
    followers = int(1 / MIN_SUFFIX_SHARE) + 1
    for token in range(followers):  # every follower of 0 under the share: no draft
        rare.add("", [0, 10 + token])
    assert rare.lookup("", [0], 3) == ([], 0)


class _Seq:
    def __init__(self, tokens, salt="", prompt=0):
        self.tokens, self.salt, self.ngram_index = tokens, salt, None
        self.num_prompt_tokens = prompt

    @property
    def num_output_tokens(self):
        return len(self.tokens) - self.num_prompt_tokens


def test_the_deeper_match_drafts():
    drafter = NgramDrafter(4, 2, 6, SuffixCorpus(2, 6, 1000))
    drafter.learn(_Seq([50, 51, 1, 2, 3, 4, 5, 6], prompt=2))  # prompt tail + output
    own = _Seq([1, 2, 9, 9, 1, 2])  # its own match (1, 2) -> 9 is 2 deep; the corpus's too
    assert drafter.propose(own, 10) == [9, 9, 1, 2] and drafter.corpus_drafts == 0
    deeper = _Seq([7, 1, 2, 3, 8, 1, 2, 3])  # own: (1, 2, 3) -> 8; the corpus: (1, 2, 3) -> 4
    assert drafter.propose(deeper, 10) == [8, 1, 2, 3]  # equal depth 3: its own
    corpus_only = _Seq([0, 4, 5])
    assert drafter.propose(corpus_only, 10) == [6] and drafter.corpus_drafts == 1
    assert drafter.propose(_Seq([0, 4, 5], salt="b"), 10) == []


def _run(engine: Engine, prompts, params) -> list[list[int]]:
    outs: dict[int, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.submit(Request(f"r{i}-{random.random()}", prompt, p,
                              on_output=lambda o, i=i: outs.setdefault(i, []).extend(
                                  o.new_token_ids)))
    while engine.has_work:
        engine.step()
    engine.scheduler.after_outputs()
    return [outs[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain():
    return Engine.from_model_dir(TINY_MODEL_DIR, EngineConfig())


def test_a_repeated_answer_is_drafted_from_the_earlier_one(plain):
    """The same question asked again (another request, a cache hit or not): its answer comes
    from drafts of the first one's, in fewer steps than tokens; the tokens are a token a
    step's. The prompt alone holds none of the answer (`ngram` drafts little)."""
    prompt = list(b"Q: What is the capital of Spain?\nA:")
    params = SamplingParams(max_tokens=60, top_k=1)
    want = _run(plain, [prompt], [params])[0]
    runs = {}
    for method in ("ngram", "suffix"):
        engine = Engine.from_model_dir(TINY_MODEL_DIR, EngineConfig(speculative_method=method,
                                                                    **SPEC))
        assert _run(engine, [prompt], [params]) == [want]
        steps = engine.stats()["steps"]
        assert _run(engine, [prompt], [params]) == [want]
        runs[method] = engine.stats()["steps"] - steps, engine.stats()
        assert_no_leak(engine)
    steps, stats = runs["suffix"]
    assert stats["spec_corpus_drafts"] > 0 and runs["ngram"][1]["spec_corpus_drafts"] == 0
    assert steps < runs["ngram"][0] and steps < len(want) // 2


def test_outputs_equal_a_token_a_step_beside_other_requests(plain):
    """Greedy and seeded requests in one batch, twice (the second batch drafts from the
    first's outputs), under two cache salts: each output is a token a step's."""
    prompts = [list(b"def add(a, b):\n    return a + b\n\ndef mul(a, b):\n"),
               list(b"Once upon a time there was a little girl."),
               list(b"The cat sat on the mat. The dog")]
    params = [SamplingParams(max_tokens=48, top_k=1),
              SamplingParams(max_tokens=48, temperature=0.7, seed=5),
              SamplingParams(max_tokens=48, top_k=1, repetition_penalty=1.1)]
    want = _run(plain, prompts, params)
    engine = Engine.from_model_dir(TINY_MODEL_DIR, EngineConfig(speculative_method="suffix",
                                                                **SPEC))
    for _ in range(2):
        assert _run(engine, prompts, params) == want
    assert engine.stats()["spec_corpus_drafts"] > 0
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert_no_leak(engine)


def test_a_prefix_cache_reset_forgets_the_namespaces_outputs():
    engine = Engine.from_model_dir(TINY_MODEL_DIR, EngineConfig(speculative_method="suffix",
                                                                **SPEC))
    prompt = list(b"Q: What is the capital of Spain?\nA:")
    params = SamplingParams(max_tokens=30, top_k=1)
    for salt in ("a", "b"):
        engine.submit(Request(salt, prompt, params, cache_salt=salt))
    while engine.has_work:
        engine.step()
    engine.scheduler.after_outputs()
    corpus = engine.scheduler.drafter.corpus
    assert {n for n, _ in corpus.requests} == {"a", "b"}
    engine.reset_prefix_cache("a", every_salt=False)
    assert {n for n, _ in corpus.requests} == {"b"}
    engine.reset_prefix_cache()
    assert not corpus.requests and not corpus.counts
    assert_no_leak(engine)


def test_config():
    assert EngineConfig(speculative_method="suffix").suffix_cache_tokens == 65536
    with pytest.raises(ValueError, match="suffix_cache_tokens must be >= 1"):
        EngineConfig(speculative_method="suffix", suffix_cache_tokens=0)
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        EngineConfig(speculative_method="eagle")
