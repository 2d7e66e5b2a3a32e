"""hybrid_llm request parsing (no server): TensorRT-LLM tensors -> engine request."""

from __future__ import annotations

import numpy as np
import pytest

from backend.triton.errors import RequestError
from backend.triton.llm_request import is_stop, parse_request, words_of

EOS = 256


def tensors(**extra: np.ndarray) -> dict[str, np.ndarray]:
    base = {
        "input_ids": np.array([[104, 105, 0, 0]], dtype=np.int32),
        "input_lengths": np.array([2], dtype=np.int32),  # reshape: { shape: [ ] }
        "request_output_len": np.array([[8]], dtype=np.int32),
    }
    return {**base, **extra}


def test_defaults_and_padding():
    req = parse_request(tensors(), EOS, exclude_input=True)
    assert req.prompt_ids == [104, 105]
    assert req.sampling.max_tokens == 8 and req.sampling.end_id == EOS
    assert not req.streaming and req.exclude_input_in_output
    assert req.cache_salt == "" and req.session_id is None


def test_sampling_and_our_inputs():
    req = parse_request(
        tensors(
            temperature=np.array([0.5], np.float32),
            runtime_top_k=np.array([[4]], np.int32),
            runtime_top_p=np.array([0.9], np.float32),
            seed=np.array([2**63 + 5], np.uint64),
            min_tokens=np.array([2], np.int32),
            end_id=np.array([7], np.int32),
            streaming=np.array([[True]]),
            exclude_input_in_output=np.array([False]),
            cache_salt=np.array([b"tenant"], dtype=np.object_),
            session_id=np.array([b"s1"], dtype=np.object_),
            priority=np.array([-3], np.int32),
        ),
        EOS,
        exclude_input=True,
    )
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.min_tokens, s.end_id) == (
        0.5,
        4,
        pytest.approx(0.9),
        2**63 + 5,
        2,
        7,
    )
    assert req.streaming and not req.exclude_input_in_output
    assert (req.cache_salt, req.session_id, req.priority) == ("tenant", "s1", -3)


def test_penalties_bias_and_log_probs():
    bias = np.zeros((1, 8), np.float32)
    bias[0, 3], bias[0, 6] = 2.5, -1.0
    req = parse_request(
        tensors(
            repetition_penalty=np.array([1.3], np.float32),
            presence_penalty=np.array([[0.5]], np.float32),
            frequency_penalty=np.array([-0.25], np.float32),
            embedding_bias=bias,
            return_log_probs=np.array([True]),
        ),
        EOS,
        exclude_input=True,
    )
    s = req.sampling
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (
        pytest.approx(1.3), 0.5, -0.25)
    assert s.logit_bias == ((3, 2.5), (6, -1.0)) and s.return_log_probs and s.penalized
    # What preprocessing sends when no bias words were given: [1, 0], no bias.
    none = parse_request(tensors(embedding_bias=np.zeros((1, 0), np.float32)), EOS, True)
    assert none.sampling.logit_bias == () and not none.sampling.penalized


def test_word_lists_in_tensorrt_llm_layout():
    # words [1, 2] and [3]: ids back to back, end offsets, padded.
    words = np.array([[[1, 2, 3, 0], [2, 3, -1, -1]]], dtype=np.int32)
    assert words_of({"stop_words_list": words}, "stop_words_list") == ((1, 2), (3,))
    assert words_of({"bad_words_list": np.zeros((1, 2, 0), np.int32)}, "bad_words_list") == ()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"input_lengths": np.array([0], np.int32)}, "prompt is empty"),
        ({"input_lengths": np.array([9], np.int32)}, "outside [0, 4]"),
        ({"request_output_len": np.array([[0]], np.int32)}, "max_tokens must be in"),
        ({"temperature": np.array([np.inf], np.float32)}, "temperature must be finite"),
        ({"runtime_top_p": np.array([0.0], np.float32)}, "top_p must be in (0, 1]"),
        ({"beam_width": np.array([65], np.int32)}, "beam_width must be in [1, 64], got 65"),
        ({"embedding_bias": np.ones((2, 3), np.float32)}, "embedding_bias must be a float"),
        ({"embedding_bias": np.ones((1, 3), np.int32)}, "embedding_bias must be a float"),
        ({"embedding_bias": np.array([[0, np.nan]], np.float32)}, "not finite"),
        ({"repetition_penalty": np.array([0.0], np.float32)}, "repetition_penalty must be"),
        ({"presence_penalty": np.array([np.inf], np.float32)}, "presence_penalty must be"),
        ({"return_log_probs": np.array([1], np.int32)}, "return_log_probs has dtype"),
        ({"temperature": np.array([0.5, 0.7], np.float32)}, "one value per request"),
        ({"cache_salt": np.array([b"\xff"], dtype=np.object_)}, "cache_salt is not valid UTF-8"),
        (
            {"stop_words_list": np.array([[[1, 2], [5, -1]]], np.int32)},
            "bad word end offset 5",
        ),
    ],
    ids=[
        "empty",
        "length",
        "max_tokens",
        "temperature",
        "top_p",
        "beam",
        "bias-shape",
        "bias-dtype",
        "bias-nan",
        "repetition",
        "presence",
        "log-probs-dtype",
        "shape",
        "utf8",
        "offsets",
    ],
)
def test_bad_requests_say_what_is_wrong(extra, message):
    with pytest.raises(RequestError, match=None) as info:
        parse_request(tensors(**extra), EOS, exclude_input=True)
    assert message in str(info.value)


def test_stop_flag():
    assert is_stop({"stop": np.array([True])})
    assert not is_stop(tensors())


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def test_guided_decoding_inputs():
    from backend.engine.guided import Guide

    assert parse_request(tensors(), EOS, exclude_input=True).sampling.guide is None
    empty = tensors(guided_decoding_guide_type=text(""))
    assert parse_request(empty, EOS, exclude_input=True).sampling.guide is None
    req = parse_request(tensors(guided_decoding_guide_type=text("regex"),
                                guided_decoding_guide=text("[0-9]+")), EOS, exclude_input=True)
    assert req.sampling.guide == Guide("regex", "[0-9]+")
    req = parse_request(tensors(guided_decoding_guide_type=text("json")), EOS,
                        exclude_input=True)
    assert req.sampling.guide == Guide("json")


@pytest.mark.parametrize("extra, message", [
    ({"guided_decoding_guide_type": text("xml")}, "must be one of json, json_schema, regex"),
    ({"guided_decoding_guide_type": text("json_schema")}, "needs a guided_decoding_guide"),
    ({"guided_decoding_guide": text("[0-9]")}, "guided_decoding_guide_type is not"),
])
def test_bad_guided_decoding_inputs(extra, message):
    with pytest.raises(RequestError, match=message):
        parse_request(tensors(**extra), EOS, exclude_input=True)


def beam(width: int, **extra: np.ndarray):
    return parse_request(tensors(beam_width=np.array([width], np.int32), **extra), EOS,
                         exclude_input=True)


def test_beam_search_is_one_engine_request_returning_every_beam():
    req = beam(4)
    s = req.sampling
    assert (s.beam_width, s.length_penalty, s.early_stopping) == (4, 1.0, False)
    assert req.beam_search and req.num_return_sequences == 4 and req.num_engine_requests == 1
    # num_return_sequences counts the beams returned (the best K of W).
    two = beam(4, num_return_sequences=np.array([2], np.int32))
    assert two.num_return_sequences == 2 and two.num_engine_requests == 1
    assert beam(64).num_return_sequences == 64
    # Without beam search each sequence is an engine request, as before.
    plain = parse_request(tensors(num_return_sequences=np.array([3], np.int32)), EOS, True)
    assert not plain.beam_search and plain.sampling.beam_width == 1
    assert (plain.num_return_sequences, plain.num_engine_requests) == (3, 3)
    one = parse_request(tensors(beam_width=np.array([[1]], np.int32)), EOS, True)
    assert one.num_return_sequences == 1 and one.num_engine_requests == 1


def test_length_penalty_and_early_stopping():
    req = beam(3, len_penalty=np.array([0.5], np.float32),
               early_stopping=np.array([1], np.int32))
    assert req.sampling.length_penalty == 0.5 and req.sampling.early_stopping is True
    assert beam(3, early_stopping=np.array([[True]])).sampling.early_stopping is True
    assert beam(3, early_stopping=np.array([0], np.int32)).sampling.early_stopping is False
    assert beam(3, early_stopping=np.array([7], np.int32)).sampling.early_stopping is True
    # Accepted (and carried) without beam search too, where they change nothing.
    plain = parse_request(tensors(len_penalty=np.array([2.0], np.float32)), EOS, True)
    assert plain.sampling.length_penalty == 2.0


@pytest.mark.parametrize(("width", "extra", "message"), [
    (0, {}, "beam_width must be in [1, 64], got 0"),
    (-3, {}, "beam_width must be in [1, 64], got -3"),
    (3, {"num_return_sequences": np.array([4], np.int32)},
     "num_return_sequences=4 must be in [1, beam_width=3]"),
    (3, {"num_return_sequences": np.array([0], np.int32)},
     "num_return_sequences=0 must be in [1, beam_width=3]"),
    (2, {"runtime_top_k": np.array([5], np.int32)},
     "top_k=5 / top_p=1.0 / min_p=0.0 do not apply to beam search"),
    (2, {"runtime_top_p": np.array([0.5], np.float32)}, "do not apply to beam search"),
    (2, {"guided_decoding_guide_type": np.array([b"json"], dtype=np.object_)},
     "guided decoding with beam search (beam_width > 1) is not supported"),
    (2, {"len_penalty": np.array([np.nan], np.float32)}, "len_penalty must be finite"),
    (2, {"early_stopping": np.array([0.5], np.float32)}, "early_stopping has dtype float32"),
    (2, {"beam_width": np.array([2.0], np.float32)}, "beam_width has dtype float32"),
], ids=["zero", "negative", "more-sequences-than-beams", "no-sequences", "top-k", "top-p",
        "guided", "len-penalty-nan", "early-stopping-dtype", "width-dtype"])
def test_bad_beam_requests_say_what_is_wrong(width, extra, message):
    inputs = tensors(beam_width=np.array([width], np.int32))
    inputs.update(extra)
    with pytest.raises(RequestError) as info:
        parse_request(inputs, EOS, exclude_input=True)
    assert message in str(info.value)


def test_retention_inputs_in_tensorrt_llm_layout():
    from backend.cache.retention import RetentionConfig, RetentionRange

    assert parse_request(tensors(), EOS, exclude_input=True).retention is None
    i32 = np.int32
    req = parse_request(tensors(
        retention_token_range_starts=np.array([[0, 64]], i32),
        retention_token_range_ends=np.array([[64, -1]], i32),
        retention_token_range_priorities=np.array([[100, 10]], i32),
        retention_token_range_durations_ms=np.array([[-1, 2500]], i32),
        retention_decode_priority=np.array([5], i32),
        retention_decode_duration_ms=np.array([[1000]], i32)), EOS, exclude_input=True)
    assert req.retention == RetentionConfig(
        ranges=(RetentionRange(0, 64, 100, None), RetentionRange(64, None, 10, 2.5)),
        decode_priority=5, decode_duration_s=1.0)
    only_decode = parse_request(tensors(retention_decode_priority=np.array([80], i32)), EOS,
                                exclude_input=True)
    assert only_decode.retention == RetentionConfig(decode_priority=80)
    with pytest.raises(RequestError, match="retention_token_range_starts must be an integer"):
        parse_request(tensors(retention_token_range_starts=np.array([[0.5]], np.float32)), EOS,
                      exclude_input=True)


def test_draft_input_ids_rows_may_be_padded_with_minus_one():
    """A batch's shorter drafts are padded with -1 at the end (as allowed_token_ids' rows);
    the padding is not part of the prediction. No draft, or all padding: none."""
    req = parse_request(tensors(draft_input_ids=np.array([[104, 105, -1, -1]], np.int32)),
                        EOS, exclude_input=True)
    assert req.prediction == [104, 105]
    for row in ([[-1, -1]], np.zeros((1, 0), np.int32)):
        req = parse_request(tensors(draft_input_ids=np.array(row, np.int32)), EOS,
                            exclude_input=True)
        assert req.prediction is None
    # -1 inside a draft is not padding: the engine refuses it as an id outside the vocabulary
    req = parse_request(tensors(draft_input_ids=np.array([[104, -1, 105]], np.int32)),
                        EOS, exclude_input=True)
    assert req.prediction == [104, -1, 105]
