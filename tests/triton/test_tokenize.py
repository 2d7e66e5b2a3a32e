from __future__ import annotations

import numpy as np
import pytest

from backend.tokenizer import byte_tokenizer
from backend.triton.errors import RequestError
from backend.triton.tokenize import Preprocessor

PAD, EOS = 259, 256


def strings(*rows: list[str | bytes]) -> np.ndarray:
    return np.array(
        [[v.encode() if isinstance(v, str) else v for v in row] for row in rows], dtype=object
    )


def request(*prompts: str | bytes, max_tokens: int = 8, **extra: np.ndarray) -> dict:
    batch = len(prompts)
    return {
        "QUERY": strings(*[[p] for p in prompts]),
        "REQUEST_OUTPUT_LEN": np.full((batch, 1), max_tokens, dtype=np.int32),
        **extra,
    }


@pytest.fixture(scope="module")
def pre():
    return Preprocessor(byte_tokenizer())


def test_prompt_ids_and_defaults(pre):
    out = pre(request("hé 世"))
    assert out["INPUT_ID"].tolist() == [list("hé 世".encode())]
    assert out["INPUT_ID"].dtype == np.int32
    assert out["REQUEST_INPUT_LEN"].tolist() == [[7]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[8]]
    assert (out["OUT_END_ID"].tolist(), out["OUT_PAD_ID"].tolist()) == ([[EOS]], [[PAD]])
    assert out["DECODER_INPUT_ID"].tolist() == [[PAD]]
    assert out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1]]
    assert out["BAD_WORDS_IDS"].shape == out["STOP_WORDS_IDS"].shape == (1, 2, 0)
    assert out["EMBEDDING_BIAS"].shape == (1, 0)


def test_batch_is_right_padded(pre):
    out = pre(request("abc", "z"))
    assert out["INPUT_ID"].tolist() == [[97, 98, 99], [122, PAD, PAD]]
    assert out["REQUEST_INPUT_LEN"].tolist() == [[3], [1]]


def test_truncate_prompt_tokens_keeps_the_last_ids(pre):
    keep = np.array([[2], [0], [9]], np.int32)  # 0: the whole prompt; more than it has: all
    out = pre(request("abcd", "xyz", "hi", TRUNCATE_PROMPT_TOKENS=keep))
    assert out["INPUT_ID"].tolist() == [[99, 100, PAD], [120, 121, 122], [104, 105, PAD]]
    assert out["REQUEST_INPUT_LEN"].tolist() == [[2], [3], [2]]
    with pytest.raises(RequestError, match=r"must be >= 0 .* got \[-1\]"):
        pre(request("abc", TRUNCATE_PROMPT_TOKENS=np.array([[-1]], np.int32)))


def test_explicit_end_and_pad_ids_pass_through(pre):
    ids = {"END_ID": np.array([[258]], np.int32), "PAD_ID": np.array([[0]], np.int32)}
    out = pre(request("a", **ids))
    assert (out["OUT_END_ID"].tolist(), out["OUT_PAD_ID"].tolist()) == ([[258]], [[0]])


def test_stop_words_use_trtllm_layout(pre):
    out = pre(request("a", "b", STOP_WORDS_DICT=strings(["ab", "c"], ["", "xyz"])))
    flat, offsets = out["STOP_WORDS_IDS"][:, 0], out["STOP_WORDS_IDS"][:, 1]
    assert flat.tolist() == [[97, 98, 99], [120, 121, 122]]
    assert offsets.tolist() == [[2, 3, -1], [3, -1, -1]]


def test_embedding_bias_adds_weights_per_token(pre):
    words = strings(["a", "ab"])
    weights = np.array([[1.5, -1.0]], dtype=np.float32)
    out = pre(request("q", EMBEDDING_BIAS_WORDS=words, EMBEDDING_BIAS_WEIGHTS=weights))
    bias = out["EMBEDDING_BIAS"]
    assert bias.shape == (1, 260) and bias[0, 97] == 0.5 and bias[0, 98] == -1.0


def test_embedding_bias_by_token_id_adds_to_the_words(pre):
    ids = np.array([[97, 259], [3, 4]], dtype=np.int32)
    weights = np.array([[2.0, -100.0], [1.0, 0.5]], dtype=np.float32)
    out = pre(request("q", "r", EMBEDDING_BIAS_TOKEN_IDS=ids, EMBEDDING_BIAS_TOKEN_WEIGHTS=weights,
                      EMBEDDING_BIAS_WORDS=strings(["a"], ["b"]),
                      EMBEDDING_BIAS_WEIGHTS=np.array([[1.5], [1.0]], dtype=np.float32)))
    expected = np.zeros((2, 260), dtype=np.float32)
    expected[0, 97], expected[0, 259], expected[1, 98], expected[1, 3], expected[1, 4] = (
        3.5, -100.0, 1.0, 1.0, 0.5)
    np.testing.assert_array_equal(out["EMBEDDING_BIAS"], expected)
    alone = pre(request("q", EMBEDDING_BIAS_TOKEN_IDS=ids[:1],
                        EMBEDDING_BIAS_TOKEN_WEIGHTS=weights[:1]))["EMBEDDING_BIAS"]
    np.testing.assert_array_equal(alone, expected[:1] - np.eye(1, 260, 97) * 1.5)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (request(b"ok \xff\xfe"), r"QUERY\[0\] is not valid UTF-8: byte 0xff at offset 3"),
        (request(""), r"QUERY\[0\] is empty"),
        (request("a", max_tokens=0), r"max_tokens\) must be >= 1, got \[0\]"),
        ({"QUERY": strings(["a", "b"])}, r"QUERY must have shape \[batch, 1\], got \[1, 2\]"),
        ({"QUERY": strings(["a"])}, "missing required input REQUEST_OUTPUT_LEN"),
        (request("a", STOP_WORDS_DICT=strings([b"\xc3"])), r"STOP_WORDS_DICT\[0\]\[0\]"),
        (
            request("a", END_ID=np.array([[1], [2]], np.int32)),
            r"END_ID must have shape \[1, 1\], got \[2, 1\]",
        ),
        (request("a", EMBEDDING_BIAS_TOKEN_IDS=np.array([[3]], np.int32)),
         "EMBEDDING_BIAS_TOKEN_WEIGHTS is missing"),
        (request("a", EMBEDDING_BIAS_TOKEN_IDS=np.array([[3, 260]], np.int32),
                 EMBEDDING_BIAS_TOKEN_WEIGHTS=np.ones((1, 2), np.float32)),
         r"outside the vocabulary \(0..259\): \[260\]"),
        (request("a", EMBEDDING_BIAS_TOKEN_IDS=np.array([[3, 3]], np.int32),
                 EMBEDDING_BIAS_TOKEN_WEIGHTS=np.ones((1, 2), np.float32)),
         r"EMBEDDING_BIAS_TOKEN_IDS\[0\] names a token id twice"),
        (request("a", EMBEDDING_BIAS_TOKEN_IDS=np.array([[3, 4]], np.int32),
                 EMBEDDING_BIAS_TOKEN_WEIGHTS=np.ones((1, 3), np.float32)),
         r"must be a float tensor of the shape of EMBEDDING_BIAS_TOKEN_IDS \[1, 2\]"),
        (request("a", EMBEDDING_BIAS_TOKEN_IDS=np.array([[3]], np.int32),
                 EMBEDDING_BIAS_TOKEN_WEIGHTS=np.array([[np.inf]], np.float32)),
         "not finite"),
        (request("a", EMBEDDING_BIAS_WORDS=strings(["a"])), "EMBEDDING_BIAS_WEIGHTS is missing"),
        (request("a", EMBEDDING_BIAS_WEIGHTS=np.ones((1, 1), np.float32)),
         "EMBEDDING_BIAS_WORDS is missing"),
        (request("a", EMBEDDING_BIAS_WORDS=strings(["a"]),
                 EMBEDDING_BIAS_WEIGHTS=np.array([[np.nan]], np.float32)),
         "EMBEDDING_BIAS_WEIGHTS holds a value that is not finite"),
        (request("a", EMBEDDING_BIAS_WORDS=strings(["xx"]),
                 EMBEDDING_BIAS_WEIGHTS=np.array([[3e38]], np.float32)),
         r"weights on token 120 of request 0 add up to inf"),
        (request("a", EMBEDDING_BIAS_WORDS=strings(["a"]),
                 EMBEDDING_BIAS_WEIGHTS=np.array([[3e38]], np.float32),
                 EMBEDDING_BIAS_TOKEN_IDS=np.array([[97]], np.int32),
                 EMBEDDING_BIAS_TOKEN_WEIGHTS=np.array([[3e38]], np.float32)),
         r"weights on token 97 of request 0 add up to inf"),
    ],
    ids=[
        "invalid-utf8",
        "empty",
        "max-tokens-0",
        "query-shape",
        "no-output-len",
        "stop-utf8",
        "end-id-shape",
        "bias-ids-alone",
        "bias-id-range",
        "bias-id-twice",
        "bias-shape",
        "bias-inf",
        "bias-words-alone",
        "bias-weights-alone",
        "bias-word-weight-nan",
        "bias-word-overflow",
        "bias-sum-overflow",
    ],
)
def test_bad_requests_raise_request_error(pre, inputs, message):
    with pytest.raises(RequestError, match=message):
        pre(inputs)
