from __future__ import annotations

import numpy as np
import pytest

from backend.tokenizer import byte_tokenizer
from backend.triton.errors import RequestError
from backend.triton.postprocess import Postprocessor

TOK = byte_tokenizer()


def tokens(*beams: list[int], width: int | None = None) -> dict[str, np.ndarray]:
    """One batch item with the given beams, right-padded to `width`."""
    width = width or max(len(b) for b in beams)
    batch = np.full((1, len(beams), width), 259, dtype=np.int32)
    for k, beam in enumerate(beams):
        batch[0, k, : len(beam)] = beam
    lengths = np.array([[len(b) for b in beams]], dtype=np.int32)
    return {"TOKENS_BATCH": batch, "SEQUENCE_LENGTH": lengths}


def texts(out: dict[str, np.ndarray]) -> list[list[str]]:
    return [[v.decode("utf-8") for v in row] for row in out["OUTPUT"]]


@pytest.fixture(scope="module")
def post():
    return Postprocessor(TOK)


def test_decodes_each_beam_up_to_its_length(post):
    out = post(tokens(TOK.encode("héllo"), TOK.encode("世界") + [256], width=12))
    assert texts(out) == [["héllo", "世界"]]
    assert out["OUTPUT"].shape == (1, 2)


def test_keeps_special_tokens_when_configured():
    out = Postprocessor(TOK, skip_special_tokens=False)(tokens([65, 258]))
    assert texts(out) == [["A<|im_end|>"]]


def streamed(post: Postprocessor, ids: list[int]) -> list[str]:
    """Each id's response, with the last 8 ids before it as hybrid_llm sends them."""
    pieces = []
    for start in range(len(ids)):
        step = tokens(ids[start : start + 1])
        prefix = ids[max(0, start - 8) : start]
        step["PREFIX_TOKENS"] = np.array([[prefix]], dtype=np.int32).reshape(1, 1, len(prefix))
        step["PREFIX_LENGTH"] = np.array([[len(prefix)]], dtype=np.int32)
        step["FLUSH"] = np.array([[start == len(ids) - 1]])
        pieces.append(texts(post(step))[0][0])
    return pieces


def test_streamed_responses_concatenate_to_full_text(post):
    pieces = streamed(post, TOK.encode("a😀 世界!"))
    assert "".join(pieces) == "a😀 世界!"
    assert pieces[1:5] == ["", "", "", "😀"]


@pytest.mark.parametrize("ids", [
    TOK.encode("\ufffd\ufffd\ufffdab"),  # real U+FFFD, 9 ids held back on text
    [*TOK.encode("中"), *[258] * 5, *TOK.encode("中")],  # hidden ids between characters
    [0xE4, 256, 256, 0xB8, 257, 0xAD, 0x80, 0xFF, *TOK.encode("é"), 0xC3],  # invalid bytes
], ids=["real-fffd", "hidden-specials", "invalid-bytes"])
def test_any_output_streams_as_it_decodes_whole(post, ids):
    # (on text, the first two streamed an extra U+FFFD: a window starting inside a character
    # held back or shown reads as U+FFFD like an unfinished one)
    assert "".join(streamed(post, ids)) == texts(post(tokens(ids)))[0][0] == TOK.decode(ids)


def test_ids_past_the_tokenizer_decode_to_nothing(post):
    """(A model's padded vocabulary: an error mid-stream left the ensemble request open.)"""
    ids = [0xE4, 999, 0xB8, 0xAD, 300, 65]
    assert "".join(streamed(post, ids)) == texts(post(tokens(ids)))[0][0] == "中A"


def test_unflushed_response_holds_back_a_split_character(post):
    step = tokens([65, 0xE4, 0xB8])
    step["FLUSH"] = np.array([[False]])
    assert texts(post(step)) == [["A"]]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"TOKENS_BATCH": np.zeros((1, 3), np.int32)}, r"TOKENS_BATCH must have shape"),
        ({}, "missing required input TOKENS_BATCH"),
        ({**tokens([65]), "SEQUENCE_LENGTH": np.array([[5]], np.int32)}, r"in \[0, 1\]"),
        ({**tokens([65]), "SEQUENCE_LENGTH": np.array([[1, 1]], np.int32)}, "does not match"),
        (tokens([65, -3]), r"TOKENS_BATCH holds ids that are no token ids: \[-3\]"),
        ({**tokens([65]), "FLUSH": np.array([[True, False]])}, r"FLUSH must have shape \[1, 1\]"),
    ],
    ids=["rank", "missing", "length-range", "length-shape", "bad-id", "flush-shape"],
)
def test_bad_requests_raise_request_error(post, inputs, message):
    with pytest.raises(RequestError, match=message):
        post(inputs)
