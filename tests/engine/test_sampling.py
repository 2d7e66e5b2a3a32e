from __future__ import annotations

import pytest
import torch
from engine_helpers import reference_adjust
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.request import SamplingParams
from backend.engine.sampling import (
    TokenCounts,
    adjust_logits,
    finish_reason,
    make_generator,
    match_stop,
    sample,
    scored_log_probs,
)

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


# Penalties, logit bias, log probabilities ----------------------------------------------------

def greedy_pick(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                generated: list[int]) -> int:
    counts = TokenCounts(V, len(prompt)).update(prompt + generated)
    return int(sample(logits[None], [params], [None], [len(generated)], [generated],
                      [counts])[0])


def test_repetition_penalty_is_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(5)
    for penalty in (0.7, 1.3, 2.0):
        logits = torch.randn(V, generator=gen) * 3
        history = torch.randint(0, V, (12,), generator=gen).tolist()
        expected = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([history]), logits[None].clone())[0]
        params = SamplingParams(repetition_penalty=penalty)
        counts = TokenCounts(V, 8).update(history)  # 8 prompt tokens, 4 generated
        row = logits.clone()
        adjust_logits(row, params, counts)
        assert torch.allclose(row, expected)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_prompt=st.integers(1, 10),
    num_generated=st.integers(0, 10),
    repetition=st.floats(0.5, 2.0),
    presence=st.floats(-1.0, 2.0),
    frequency=st.floats(-1.0, 2.0),
    bias=st.floats(-5.0, 5.0),
)
def test_penalties_and_bias_follow_the_documented_rules(seed, num_prompt, num_generated,
                                                       repetition, presence, frequency, bias):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=gen) * 2
    # few distinct ids, so repeats happen
    ids = torch.randint(0, 6, (num_prompt + num_generated,), generator=gen).tolist()
    prompt, generated = ids[:num_prompt], ids[num_prompt:]
    params = SamplingParams(repetition_penalty=repetition, presence_penalty=presence,
                            frequency_penalty=frequency, logit_bias=((3, bias), (V - 1, -bias)),
                            top_k=1)
    expected = reference_adjust(logits, prompt, generated, params)
    assert greedy_pick(logits, params, prompt, generated) == int(expected.argmax())
    row = logits.clone()
    adjust_logits(row, params, TokenCounts(V, num_prompt).update(prompt + generated))
    assert torch.allclose(row, expected, atol=1e-5)


def test_presence_and_frequency_ignore_the_prompt():
    logits = torch.zeros(V)
    logits[2], logits[7] = 1.0, 0.9
    params = SamplingParams(presence_penalty=0.5, top_k=1)
    assert greedy_pick(logits, params, prompt=[2, 2, 2], generated=[]) == 2
    assert greedy_pick(logits, params, prompt=[], generated=[2]) == 7
    freq = SamplingParams(frequency_penalty=0.05, top_k=1)
    assert greedy_pick(logits, freq, prompt=[], generated=[2]) == 2  # 0.95 > 0.9
    assert greedy_pick(logits, freq, prompt=[], generated=[2, 2, 2]) == 7  # 0.85 < 0.9


def test_logit_bias_moves_greedy_and_sampled_choices():
    logits = peaked_logits(4)
    low = int(logits.argmin())
    params = SamplingParams(logit_bias=((low, 100.0),), top_k=1)
    assert int(sample(logits[None], [params], [None], [0])[0]) == low
    hot = SamplingParams(logit_bias=((low, 100.0),), temperature=2.0)
    assert set(draw_many(logits, hot, 50)) == {low}


def test_penalties_without_counts_are_an_error():
    with pytest.raises(ValueError, match="token counts"):
        sample(torch.zeros(1, V), [SamplingParams(repetition_penalty=1.2)], [None], [0])


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(0, V - 1), min_size=1, max_size=30),
       num_prompt=st.integers(0, 30), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_token_counts_grow_incrementally_like_a_recount(ids, num_prompt, cuts):
    counts = TokenCounts(V, num_prompt)
    for n in sorted(cuts) + [len(ids)]:
        counts.update(ids[:n])
    fresh = TokenCounts(V, num_prompt).update(ids)
    assert torch.equal(counts.in_prompt, fresh.in_prompt)
    assert torch.equal(counts.generated, fresh.generated)
    assert fresh.in_prompt.nonzero().view(-1).tolist() == sorted(set(ids[:num_prompt]))
    assert fresh.generated.tolist() == [ids[num_prompt:].count(t) for t in range(V)]
    counts.update(ids[:1])  # shorter than counted: counted again
    assert counts.num_counted == 1


def test_scored_log_probs_are_the_raw_log_softmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(9))
    tokens = torch.tensor([0, 5, V - 1])
    reference = torch.log_softmax(logits.double(), -1)
    expected = [float(reference[i, t]) for i, t in enumerate(tokens)]
    chosen, ids, values = scored_log_probs(logits, tokens, 3)
    assert chosen.tolist() == pytest.approx(expected, abs=1e-5)
    for i in range(3):  # the three likeliest, likeliest first
        order = sorted(range(V), key=lambda t: -float(reference[i, t]))[:3]
        assert ids[i].tolist() == order
        assert values[i].tolist() == pytest.approx([float(reference[i, t]) for t in order],
                                                   abs=1e-5)
    assert scored_log_probs(logits, tokens, 0)[1].shape == (3, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty must be finite"),
        (dict(presence_penalty=float("inf")), "presence_penalty must be finite"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty must be finite"),
        (dict(logit_bias=((1, 1.0), (1, 2.0))), "names a token id twice"),
        (dict(logit_bias=((1, float("nan")),)), "not finite"),
    ],
)
def test_bad_penalties_and_biases_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_p_keeps_tokens_near_the_likeliest():
    # probs 0.5, 0.3, 0.15, 0.05: min_p = 0.25 keeps those >= 0.125 (ids 1, 3, 0), drawn in
    # proportion to their probabilities; temperature applies first.
    logits = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    drawn = draw_many(logits, SamplingParams(min_p=0.25), 3000)
    freq = torch.bincount(torch.tensor(drawn), minlength=4).float() / len(drawn)
    assert torch.allclose(freq, torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95, atol=0.04)
    assert set(draw_many(logits, SamplingParams(min_p=0.5), 300)) == {1, 3}
    # Hot: 0.05 is no longer below a quarter of the likeliest (all four stay).
    assert set(draw_many(logits, SamplingParams(min_p=0.25, temperature=4.0), 400)) == \
        {0, 1, 2, 3}
    assert set(draw_many(logits, SamplingParams(min_p=1.0), 100)) == {1}


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_bad_min_p_says_what_is_wrong(value):
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=value)
