from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.request import SamplingParams
from backend.engine.sampling import finish_reason, make_generator, match_stop, sample

V = 32


def draw_many(
    logits: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0
) -> list[int]:
    """`num_draws` single-row draws from one seeded generator (as one request's steps)."""
    generator = make_generator(seed)
    return [int(sample(logits[None], [params], [generator], [0])[0]) for _ in range(num_draws)]


def peaked_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def test_top_k_never_leaves_the_top_k():
    logits = peaked_logits()
    top2 = set(logits.topk(2).indices.tolist())
    drawn = draw_many(logits, SamplingParams(top_k=2, temperature=5.0), 300)
    assert set(drawn) == top2  # both appear with a hot temperature, nothing else does


def test_small_top_p_is_argmax():
    logits = peaked_logits(1)
    drawn = draw_many(logits, SamplingParams(top_p=1e-6, temperature=2.0), 100)
    assert set(drawn) == {int(logits.argmax())}


def test_top_p_keeps_the_nucleus_only():
    # probs 0.5, 0.3, 0.15, 0.05: top_p = 0.7 keeps the first two.
    logits = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    drawn = draw_many(logits, SamplingParams(top_p=0.7), 400)
    assert set(drawn) == {1, 3}


def test_full_distribution_matches_softmax():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    drawn = draw_many(logits, SamplingParams(), 3000)
    freq = torch.bincount(torch.tensor(drawn), minlength=3).float() / len(drawn)
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04)


@pytest.mark.parametrize(
    "params", [SamplingParams(top_k=1), SamplingParams(temperature=0.0)], ids=["top_k1", "temp0"]
)
def test_greedy_takes_argmax_without_a_generator(params):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    out = sample(logits, [params] * 4, [None] * 4, [0] * 4)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_different_seeds_differ():
    logits = torch.zeros(V)  # uniform: any difference comes from the generator
    params = SamplingParams(temperature=1.0)
    assert draw_many(logits, params, 20, seed=7) == draw_many(logits, params, 20, seed=7)
    assert draw_many(logits, params, 20, seed=7) != draw_many(logits, params, 20, seed=8)


def test_seeded_row_ignores_its_batch_neighbours():
    logits = torch.zeros(3, V)
    params = SamplingParams()
    alone = draw_many(logits[0], params, 10, seed=11)
    gen, others = make_generator(11), [make_generator(1), None]
    batched = [int(sample(logits, [params] * 3, [gen, *others], [0] * 3)[0]) for _ in range(10)]
    assert batched == alone


def test_min_tokens_masks_end_id_until_reached():
    logits = torch.full((V,), -10.0)
    logits[5] = 10.0  # the end id is by far the likeliest token
    params = SamplingParams(min_tokens=3, max_tokens=8, end_id=5, top_k=1)
    picks = [int(sample(logits[None], [params], [None], [n])[0]) for n in range(5)]
    assert picks[:3] != [5, 5, 5] and 5 not in picks[:3]
    assert picks[3:] == [5, 5]


def test_single_token_bad_words_never_produced():
    logits = peaked_logits(2)
    top = logits.topk(3).indices.tolist()
    params = SamplingParams(bad_words=((top[0],), (top[1],)), temperature=3.0)
    drawn = draw_many(logits, params, 300)
    assert top[0] not in drawn and top[1] not in drawn
    greedy = SamplingParams(bad_words=((top[0],),), top_k=1)
    assert int(sample(logits[None], [greedy], [None], [0])[0]) == top[1]


def test_multi_token_bad_word_masked_only_after_its_prefix():
    logits = torch.full((V,), -10.0)
    logits[9] = 10.0
    params = SamplingParams(bad_words=((4, 9),), top_k=1)
    after_prefix = sample(logits[None], [params], [None], [2], histories=[[1, 4]])
    elsewhere = sample(logits[None], [params], [None], [2], histories=[[4, 1]])
    assert int(after_prefix[0]) != 9
    assert int(elsewhere[0]) == 9


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    top_k=st.integers(0, V),
    top_p=st.floats(0.01, 1.0),
    temperature=st.floats(0.05, 4.0),
)
def test_draws_respect_top_k_and_bad_words(seed, top_k, top_p, temperature):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed % 1000))
    banned = int(logits.argmax())
    params = SamplingParams(
        top_k=top_k, top_p=top_p, temperature=temperature, bad_words=((banned,),)
    )
    allowed = logits.clone()
    allowed[banned] = float("-inf")
    ranked = allowed.argsort(descending=True, stable=True).tolist()
    keep = set(ranked[:top_k]) if top_k else set(ranked)
    for token in draw_many(logits, params, 5, seed):
        assert token != banned and token in keep


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 rows of logits but 1 params"):
        sample(torch.zeros(2, V), [SamplingParams()], [None, None], [0, 0])


def test_match_stop_looks_at_the_end_only():
    assert match_stop([1, 2, 3], [(2, 3)])
    assert match_stop([1, 2, 3], [(7,), (3,)])
    assert not match_stop([2, 3, 1], [(2, 3)])
    assert not match_stop([3], [(2, 3)])


def test_finish_reason_rules():
    params = SamplingParams(max_tokens=5, min_tokens=2, end_id=0, stop_words=((8, 9),))
    assert finish_reason([0], params) is None  # end id before min_tokens
    assert finish_reason([3, 0], params) == "eos"
    assert finish_reason([8, 9], params) == "stop"
    assert finish_reason([9], SamplingParams(stop_words=((9,),))) == "stop"
    assert finish_reason([1, 2, 3, 4], params) is None
    assert finish_reason([1, 2, 3, 4, 5], params) == "length"
