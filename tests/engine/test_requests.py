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


def test_float_prompt_ids_are_refused_at_submit_not_in_the_batch(engine):
    """Float ids pass a range check: refused at submit, they no longer reach the step,
    where they failed every request of the batch (a plain one beside them included)."""
    from backend.engine import Request

    vocab = engine.model_config.vocab_size
    outs = []
    engine.submit(Request("plain", random_prompt(60, vocab, seed=6),
                          SamplingParams(max_tokens=8, top_k=1), on_output=outs.append))
    with pytest.raises(ValueError, match="token ids must be int32 integers"):
        engine.submit(Request("floats", [1.0, 2.0, 3.0], SamplingParams(max_tokens=2)))
    while engine.has_work:
        engine.step()
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    assert_no_leak(engine)


@pytest.mark.parametrize("salt", [5, b"bytes"])
def test_a_cache_salt_that_is_not_text_is_refused(engine, salt):
    with pytest.raises(ValueError, match="cache_salt must be a str"):
        engine.generate([1, 2, 3], SamplingParams(max_tokens=2), cache_salt=salt)
    with pytest.raises(ValueError, match="cache_salt must be a str"):
        engine.reset_prefix_cache(cache_salt=salt, every_salt=False)
    assert_no_leak(engine)


def test_an_ssd_folder_that_is_a_file_is_a_clear_error(engine, tmp_path):
    from dataclasses import replace

    from backend.cache.tier_config import TierConfig
    from backend.engine import Engine

    (tmp_path / "ssd").write_text("not a folder")
    tiers = TierConfig(host_pages=4, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m",
                       ssd_bytes=1 << 20)
    with pytest.raises(ValueError, match="folder .*ssd cannot be used"):
        Engine(engine.model, replace(engine.config, tiers=tiers))


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
