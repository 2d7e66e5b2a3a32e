"""Request validation at the engine: ids a request names must be in the model's vocabulary
(end_id -1 excepted: no end token), and end_id -1 runs to max_tokens."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import assert_no_leak, make_engine, random_prompt
from hf_oracle import make_hf_checkpoint

from backend.engine import SamplingParams
from backend.model import load_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("request-model")
    make_hf_checkpoint(path, seed=3)
    return make_engine(load_model(path))


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(end_id=10_000), "end_id=10000 is outside the vocabulary"),
    (SamplingParams(end_id=-2), "end_id=-2 is outside the vocabulary"),
    (SamplingParams(stop_words=((1, 10_000),)), "stop_words hold token ids [10000]"),
    (SamplingParams(bad_words=((-3,),)), "bad_words hold token ids [-3]"),
])  # fmt: skip
def test_ids_outside_the_vocabulary_are_rejected(engine, params, message):
    prompt = random_prompt(20, engine.model_config.vocab_size, seed=1)
    with pytest.raises(ValueError, match=r"\[0, \d+\)") as exc:
        engine.generate(prompt, params)
    assert message in str(exc.value)
    assert_no_leak(engine)


@pytest.mark.parametrize("where", [0, 7, 19])
@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_prompt_ids_outside_the_vocabulary_are_rejected(engine, where, bad):
    """Anywhere in the prompt, below 0 or at the vocabulary's size: named in the error."""
    vocab = engine.model_config.vocab_size
    prompt = random_prompt(20, vocab, seed=4)
    prompt[where] = vocab if bad == "vocab" else bad
    with pytest.raises(ValueError) as exc:
        engine.generate(prompt, SamplingParams(max_tokens=2))
    assert f"token ids [{prompt[where]}] are outside the vocabulary [0, {vocab})" in str(exc.value)
    assert_no_leak(engine)


def test_numpy_prompt_ids_are_accepted(engine):
    """An in-process caller's numpy ids (the served path converts them to ints) pass the
    vocabulary check and give the tokens their int values give."""
    prompt = random_prompt(20, engine.model_config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=4, top_k=1)
    out = engine.generate(list(np.array(prompt, dtype=np.int64)), params)
    ref = engine.generate(prompt, params)
    assert out.finish_reason == "length" and out.new_token_ids == ref.new_token_ids


def test_end_id_minus_one_runs_to_max_tokens(engine):
    prompt = random_prompt(20, engine.model_config.vocab_size, seed=2)
    ref = engine.generate(prompt, SamplingParams(max_tokens=12, top_k=1, end_id=-1))
    assert len(ref.new_token_ids) == 12 and ref.finish_reason == "length"
    # A real end id stops at its first occurrence (here: the 4th token's id), not returned.
    end = ref.new_token_ids[3]
    stopped = engine.generate(prompt, SamplingParams(max_tokens=12, top_k=1, end_id=end))
    assert stopped.new_token_ids == ref.new_token_ids[:ref.new_token_ids.index(end)]
    assert stopped.finish_reason != "length"
    assert_no_leak(engine)
