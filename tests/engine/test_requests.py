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


# Values a range check alone let through, each of which failed the whole batch's step (the
# plain request beside it included) or never ended: refused at submit now, naming the field.
BAD_SAMPLING = [
    (dict(seed=2**64), "seed must be in"),
    (dict(seed=-2**63 - 1), "seed must be in"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(beam_width=2.0), "beam_width must be an integer"),
    (dict(top_log_probs=2.0), "top_log_probs must be an integer"),
    (dict(top_log_probs=True), "top_log_probs must be an integer"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size must be an integer"),
    (dict(max_tokens=10.5), "max_tokens must be an integer"),
    (dict(bad_words=((3.0,),)), "bad_words token ids must be an integer"),
    (dict(end_id=3.0, min_tokens=2), "end_id must be an integer"),
    (dict(temperature="hot"), "temperature must be a number"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SAMPLING,
                         ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))
                              for k, _ in BAD_SAMPLING])
def test_sampling_values_of_the_wrong_type_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"max_tokens": 4, **kwargs})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("prediction", [5, "7"], "prediction's token ids must be int32 integers"),
    ("deadline", float("nan"), "deadline must be a finite time"),
    ("deadline", "soon", "deadline must be a finite time"),
    ("deadline", 10 ** 400, "deadline must be a finite time"),  # (was an OverflowError)
    ("cache_salt", "\ud800", "cache_salt must be valid Unicode text"),
])
def test_request_values_that_would_fail_the_step_are_refused(engine, field, value, message):
    from backend.engine import Request

    request = Request("bad", random_prompt(20, engine.model_config.vocab_size, seed=7),
                      SamplingParams(max_tokens=2), **{field: value})
    with pytest.raises(ValueError, match=message):
        engine.submit(request)
    assert_no_leak(engine)


def _beside_a_plain_request(engine, params: SamplingParams) -> tuple[list, list]:
    """`params` decoding in the same steps as a plain greedy request; both outputs."""
    from backend.engine import Request

    vocab = engine.model_config.vocab_size
    plain, other = [], []
    engine.submit(Request("plain", random_prompt(40, vocab, seed=8),
                          SamplingParams(max_tokens=8, top_k=1), on_output=plain.append))
    engine.submit(Request("other", random_prompt(40, vocab, seed=9), params,
                          on_output=other.append))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < 2000
    return plain, other


@pytest.mark.parametrize("case", ["top_p_below_float32", "every_token_a_bad_word",
                                  "no_repeat_runs_out"])
def test_rows_left_without_a_token_never_fail_the_batch(engine, case):
    """A top_p that float32 reads as 0, bad words covering the vocabulary, and
    no_repeat_ngram_size 1 outliving the vocabulary left a sampled row with no token (NaN
    probabilities: torch.multinomial raised and the step failed both requests); the bans
    now give way (the model's own logits), and top_p keeps the likeliest token."""
    vocab = engine.model_config.vocab_size
    params = {
        "top_p_below_float32": SamplingParams(max_tokens=6, temperature=0.8, seed=1,
                                              top_p=1e-46),
        "every_token_a_bad_word": SamplingParams(max_tokens=6, temperature=0.8, seed=2,
                                                 bad_words=tuple((t,) for t in range(vocab))),
        "no_repeat_runs_out": SamplingParams(max_tokens=vocab + 20, temperature=0.8, seed=3,
                                             no_repeat_ngram_size=1, end_id=-1),
    }[case]
    plain, other = _beside_a_plain_request(engine, params)
    assert [o.finish_reason for o in plain if o.finished] == ["length"]
    assert [o.finish_reason for o in other if o.finished] == ["length"]
    tokens = [t for o in other for t in o.new_token_ids]
    assert len(tokens) == params.max_tokens
    assert_no_leak(engine)


def test_a_request_that_fails_its_admission_ends_with_an_error(engine, monkeypatch):
    """Whatever fails while a request is admitted (here: its generator) ends it with an error
    output and gives its run slot back (it used to end in neither queue: no final output,
    a slot lost for good)."""
    import backend.engine.scheduler as scheduler

    free = len(engine.scheduler.free_slots)
    real = scheduler.make_generator

    def broken(seed, *args, **kwargs):
        if seed == 12345:
            raise RuntimeError("injected")
        return real(seed, *args, **kwargs)

    monkeypatch.setattr(scheduler, "make_generator", broken)
    _, other = _beside_a_plain_request(engine, SamplingParams(max_tokens=4, seed=12345))
    assert [o.finish_reason for o in other if o.finished] == ["error"]
    assert len(engine.scheduler.free_slots) == free
    assert_no_leak(engine)
    assert engine.generate([1, 2, 3], SamplingParams(max_tokens=2)).finish_reason == "length"
