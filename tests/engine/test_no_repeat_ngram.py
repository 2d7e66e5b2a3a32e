"""no_repeat_ngram_size (transformers' and TensorRT-LLM's parameter): `RepeatedNgrams` against a
full scan; the engine's greedy tokens against transformers' `generate(no_repeat_ngram_size=n)`
on the trained default model, and on every family against the plain model's greedy search;
beams against a reference search; the same tokens with speculative drafts and beside other
requests; sampled outputs never repeat an n-gram; a grammar's only choice stands."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import (
    TINY_MODEL_DIR,
    assert_no_leak,
    make_engine,
    reference_bans,
    reference_beams,
)

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.guided import Guide
from backend.engine.request import Request
from backend.engine.sampling import RepeatedNgrams

PROMPTS = [
    list(b"The cat sat on the mat. The cat sat on the mat. The cat sat on the"),
    list(b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef "),
    list(b"Once upon a time there was a little girl. Once upon a time there"),
]


def repeats(prompt: list[int], output: list[int], n: int) -> bool:
    """Whether a generated token completes an n-gram seen before it (the prompt may repeat
    its own)."""
    tokens = prompt + output
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    first_new = max(0, len(prompt) - n + 1)  # the first n-gram that ends in the output
    return any(grams[j] in grams[:j] for j in range(first_new, len(grams)))


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_index_bans_what_a_full_scan_bans(n):
    rng = random.Random(n)
    tokens = [rng.randrange(6) for _ in range(4)]
    index = RepeatedNgrams(n)
    for step in range(120):
        assert index.update(tokens).banned(tokens) == reference_bans(tokens, n), step
        if step % 7 == 0:  # several tokens at once (drafts, jump-forward)
            tokens += [rng.randrange(6) for _ in range(3)]
        elif step == 60:  # a shorter list (a search restarted): indexed again from the start
            tokens = tokens[:10]
        else:
            tokens.append(rng.randrange(6))
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be >= 1"):
        RepeatedNgrams(0)
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be >= 0, got -1"):
        SamplingParams(no_repeat_ngram_size=-1)


def hf_greedy(hf, prompt, n, max_tokens, **options):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                      no_repeat_ngram_size=n, eos_token_id=None, pad_token_id=259, **options)
    return out[:, len(prompt):].tolist()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_greedy_tokens_are_transformers(hf, engine, n):
    params = SamplingParams(max_tokens=40, top_k=1, no_repeat_ngram_size=n)
    for prompt in PROMPTS:
        out = engine.generate(prompt, params)
        [expected] = hf_greedy(hf, prompt, n, 40)
        assert out.new_token_ids == expected
        assert not repeats(prompt, out.new_token_ids, n)
        plain = engine.generate(prompt, SamplingParams(max_tokens=40, top_k=1))
        if n == 2:  # the plain model repeats itself on these prompts
            assert plain.new_token_ids != expected
    assert_no_leak(engine)


def test_every_family_bans_by_the_whole_sequence_cached_or_not(family_model):
    """A reference greedy loop (logits from scratch, bans by full scan) on every family; the
    same tokens again when the prompt is served from the prefix cache (its tokens still
    count)."""
    engine = make_engine(family_model)
    V = family_model.config.vocab_size
    prompt = [t % V for t in PROMPTS[0]] * 2  # past a page: the second request hits
    for n in (1, 2):  # 1: no token of the prompt (a fifth of the vocabulary) comes again
        params = SamplingParams(max_tokens=20, top_k=1, no_repeat_ngram_size=n)
        expected: list[int] = []
        for _ in range(20):
            with torch.inference_mode():
                row = family_model.logits(torch.tensor([prompt + expected]))[0, -1].float()
                for token in reference_bans(prompt + expected, n):
                    row[token] = float("-inf")
            expected.append(int(row.argmax()))
        first = engine.generate(prompt, params)
        again = engine.generate(prompt, params)
        assert first.new_token_ids == again.new_token_ids == expected
        assert again.cached_tokens > 0
    assert_no_leak(engine)


def test_beams_are_a_reference_searchs(engine):
    """Beam scores are the log-softmax after the bans (as after bad words: TensorRT-LLM's
    order, so transformers' beams, scored before its processors, can differ): the engine's
    beams are those of a search that prefills each beam from scratch and bans by full scan."""
    for prompt in PROMPTS[:2]:
        for n in (2, 3):
            params = SamplingParams(max_tokens=24, beam_width=3, no_repeat_ngram_size=n,
                                    end_id=10)
            out = engine.generate(prompt, params)
            assert [b.token_ids for b in out.beams] == reference_beams(engine.model, prompt,
                                                                       params)
            for beam in out.beams:
                assert not repeats(prompt, beam.token_ids, n)
    assert_no_leak(engine)


def test_speculative_drafts_and_neighbours_change_nothing(engine):
    """Drafts (prompt lookup proposes exactly the repeats this bans) are verified position by
    position: the tokens equal a plain engine's; so do a batch's, each row its own n."""
    spec = Engine.from_model_dir(TINY_MODEL_DIR, EngineConfig(
        speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
        prompt_lookup_max=6, speculative_adaptive=False))
    params = [SamplingParams(max_tokens=32, top_k=1, no_repeat_ngram_size=n) for n in (2, 3, 0)]
    want = [engine.generate(p, q).new_token_ids for p, q in zip(PROMPTS, params)]
    outs: dict[str, list[int]] = {}
    for i, (prompt, q) in enumerate(zip(PROMPTS, params)):
        spec.submit(Request(f"r{i}", prompt, q, on_output=lambda o: outs.setdefault(
            o.request_id, []).extend(o.new_token_ids)))
    while spec.has_work:
        spec.step()
    assert [outs[f"r{i}"] for i in range(3)] == want
    assert spec.stats()["spec_draft_tokens"] > 0
    assert_no_leak(spec)


def test_sampled_outputs_never_repeat_an_ngram(engine):
    for seed in range(4):
        params = SamplingParams(max_tokens=60, temperature=1.3, seed=seed,
                                no_repeat_ngram_size=2)
        out = engine.generate(PROMPTS[seed % 3], params)
        assert len(out.new_token_ids) == 60
        assert not repeats(PROMPTS[seed % 3], out.new_token_ids, 2)


def test_a_grammars_only_choice_stands(engine):
    """A guide that allows one token where it repeats an n-gram: the grammar wins (as with
    bad words), and the output still follows it."""
    guide = Guide("regex", "(ab){4}")
    out = engine.generate(list(b"abab"), SamplingParams(max_tokens=12, top_k=1, guide=guide,
                                                        no_repeat_ngram_size=2))
    assert bytes(out.new_token_ids) == b"abababab"
