from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.detokenize import DEFAULT_CONTEXT_LEN, IncrementalDecoder, decode_delta
from backend.tokenizer import byte_tokenizer

TOK = byte_tokenizer()


def stream_stateless(ids: list[int], cuts: list[int], context_len: int) -> str:
    """What a client sees when postprocessing decodes each response with a prefix window."""
    bounds = sorted({0, len(ids), *cuts})
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        prefix = ids[max(0, start - context_len) : start]
        pieces.append(decode_delta(TOK.decode, prefix, ids[start:end], end == len(ids)))
    return "".join(pieces)


def test_delta_holds_back_then_completes():
    snowman = list("☃".encode())
    assert decode_delta(TOK.decode, [], [65, *snowman[:2]], final=False) == "A"
    assert decode_delta(TOK.decode, [65, *snowman[:2]], snowman[2:], final=False) == "☃"


def test_delta_final_emits_unfinished_character():
    assert decode_delta(TOK.decode, [65], [0xE4, 0xB8], final=True) == "\ufffd"
    assert decode_delta(TOK.decode, [65, 0xE4, 0xB8], [], final=True) == "\ufffd"


def test_delta_skips_special_tokens_unless_asked():
    assert decode_delta(TOK.decode, [65], [256, 66]) == "B"
    assert decode_delta(TOK.decode, [65], [256], skip_special_tokens=False) == "<|endoftext|>"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40), st.lists(st.integers(0, 200), max_size=12))
def test_stateless_stream_equals_full_decode_for_valid_text(text, cuts):
    ids = TOK.encode(text)
    assert stream_stateless(ids, cuts, DEFAULT_CONTEXT_LEN) == TOK.decode(ids)


def test_incremental_decoder_rejects_bad_context_len():
    with pytest.raises(ValueError, match="context_len must be >= 1, got 0"):
        IncrementalDecoder(TOK.decode, context_len=0)


def test_incremental_decoder_keeps_a_short_window():
    decoder = TOK.incremental_decoder(context_len=4)
    text = "ab世😀" * 50
    assert "".join(decoder.push(i) for i in TOK.encode(text)) == text
    assert len(decoder._window) <= 2 * 4 + 4
