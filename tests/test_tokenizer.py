from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.tokenizer import (
    BYTE_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    byte_tokenizer,
    load_tokenizer,
    main,
    write_byte_tokenizer,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER_DIR = ROOT / "model_repo" / "hybrid_llm" / "1" / "tiny_qwen3_5"
SAMPLES = ["", "hello", " leading and trailing ", "héllo wörld", "世界", "😀🚀", "a\r\n\t\x00b"]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.mark.parametrize("text", SAMPLES, ids=range(len(SAMPLES)))
def test_ids_are_the_utf8_bytes(tok, text):
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trips_any_text(text):
    tok = byte_tokenizer()
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_decodes_any_bytes_like_python(data):
    assert byte_tokenizer().decode(list(data)) == data.decode("utf-8", errors="replace")


def test_special_tokens(tok):
    assert tok.vocab_size == BYTE_VOCAB_SIZE == 260
    assert tok.special_tokens == {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    assert (tok.eos_token_id, tok.pad_token_id) == (256, 259)
    assert tok.token_id("<|im_start|>") == 257
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 257 and ids[-1] == 258
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    with pytest.raises(ValueError, match="<\\|nope\\|>"):
        tok.token_id("<|nope|>")


def test_incremental_decoder_holds_back_split_characters(tok):
    decoder = tok.incremental_decoder()
    pieces = [decoder.push(i) for i in tok.encode("a😀b世")]
    assert pieces == ["a", "", "", "", "😀", "b", "", "", "世"]
    assert decoder.flush() == ""


def test_incremental_decoder_flushes_an_unfinished_character(tok):
    decoder = tok.incremental_decoder()
    assert decoder.push([ord("x"), 0xE4, 0xB8]) == "x"
    assert decoder.flush() == "\ufffd"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([0x41, 0xE4, 0xB8, 0x96, 0xF0, 0x9F, 0x98, 0xFF, 256, 258])),
    st.integers(1, 8),
)
def test_incremental_decoder_equals_full_decode(ids, context_len):
    tok = byte_tokenizer()
    decoder = tok.incremental_decoder(context_len=context_len)
    streamed = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert streamed == tok.decode(ids)


def test_saved_file_loads_in_tokenizers_and_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    file = write_byte_tokenizer(tmp_path)
    text = "héllo 世界 😀 <|im_end|>"
    expected = build_byte_tokenizer().encode(text).ids
    assert tokenizers.Tokenizer.from_file(str(file)).encode(text).ids == expected
    hf = PreTrainedTokenizerFast(tokenizer_file=str(file))
    assert hf.encode(text) == expected
    assert hf.decode(expected, skip_special_tokens=True) == "héllo 世界 😀 "


def test_default_model_tokenizer_is_the_byte_tokenizer():
    saved = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    assert saved == json.loads(build_byte_tokenizer().to_str())
    loaded = load_tokenizer(DEFAULT_TOKENIZER_DIR)
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.vocab_size) == (256, 259, 260)


def test_load_accepts_file_or_directory(tmp_path):
    file = write_byte_tokenizer(tmp_path)
    assert load_tokenizer(file).encode("ab") == load_tokenizer(tmp_path).encode("ab") == [97, 98]


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=str(bad)):
        load_tokenizer(tmp_path)


def test_cli_writes_tokenizer(tmp_path, capsys):
    main(["--write", str(tmp_path / "out")])
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert load_tokenizer(tmp_path / "out").eos_token_id == 256
    assert "tokenizer.json" in capsys.readouterr().out


CORPUS = ["héllo wörld, hello world", "the quick brown fox", "世界 and 😀 again", "hello there"]


def _trained(kind: str) -> tokenizers.Tokenizer:
    """A small real tokenizer trained here: GPT-2-style byte-level BPE with merges, or a
    SentencePiece-style BPE (Metaspace, byte fallback) as Llama 2 / Mistral ship."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "byte_level":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>"] + [
            f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_token_bytes_join_to_the_text(kind):
    """Each token's bytes, alone, joined over an encoding, are the text's UTF-8 (merged
    pieces, multi-byte characters split over tokens, byte fallback), and special tokens are
    their text."""
    from backend.tokenizer import Tokenizer

    tok = Tokenizer(_trained(kind))
    for text in CORPUS + ["hello wörld 世界 and ünknown ☃"]:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8"), (kind, text)
        if kind == "byte_level":
            assert any(len(tok.token_bytes(i)) > 1 for i in ids)  # merges, not single bytes
    special = tok.special_tokens
    first = next(iter(special))
    assert tok.token_bytes(special[first]) == first.encode()
    assert tok.token_bytes(10**6) == b""
    assert tok._byte_level == (kind == "byte_level")
