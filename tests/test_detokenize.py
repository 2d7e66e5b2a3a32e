from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.detokenize import DEFAULT_CONTEXT_LEN, IncrementalDecoder, bytes_delta, decode_delta
from backend.tokenizer import Tokenizer, byte_tokenizer
from tests.test_tokenizer import _trained

TOK = byte_tokenizer()


def stream_stateless(ids: list[int], cuts: list[int], context_len: int, delta=None) -> str:
    """What a client sees when postprocessing decodes each response with a prefix window."""
    delta = delta or (lambda prefix, new, final: decode_delta(TOK.decode, prefix, new, final))
    bounds = sorted({0, len(ids), *cuts})
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        prefix = ids[max(0, start - context_len) : start]
        pieces.append(delta(prefix, ids[start:end], end == len(ids)))
    return "".join(pieces)


def on_bytes(tok: Tokenizer, skip: bool):
    return lambda prefix, new, final: bytes_delta(lambda i: tok.shown_bytes(i, skip), prefix,
                                                  new, final)


def few_hidden_in_a_row(ids: list[int]) -> bool:
    """At most 4 special ids in a row: an unfinished character's first byte stays inside an
    8-id window (the one limit of the stateless form)."""
    run = 0
    for i in ids:
        run = run + 1 if i >= 256 else 0
        if run > 4:
            return False
    return True


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 259), max_size=48).filter(few_hidden_in_a_row),
       st.lists(st.integers(0, 60), max_size=16), st.booleans())
def test_byte_stream_equals_full_decode_for_any_ids(ids, cuts, skip):
    """Invalid bytes, real U+FFFD, special tokens (shown or hidden) anywhere."""
    streamed = stream_stateless(ids, cuts, DEFAULT_CONTEXT_LEN, on_bytes(TOK, skip))
    assert streamed == TOK.decode(ids, skip_special_tokens=skip)


BPE = Tokenizer(_trained("byte_level"))


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab wöé世界😀\ufffd"), max_size=30),
       st.lists(st.integers(0, 40), max_size=10))
def test_byte_stream_of_merged_pieces_equals_full_decode(text, cuts):
    ids = BPE.encode(text)
    assert stream_stateless(ids, cuts, DEFAULT_CONTEXT_LEN, on_bytes(BPE, True)) == text


def test_decodes_bytes_is_the_byte_level_decoders():
    assert TOK.decodes_bytes and BPE.decodes_bytes
    assert not Tokenizer(_trained("sentencepiece")).decodes_bytes


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
