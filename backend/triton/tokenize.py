"""Preprocessing: prompt text -> token ids, with the tensor contract of TensorRT-LLM's
`inflight_batcher_llm/preprocessing` (text-only subset; multimodal inputs are not served).

Inputs (B = batch, every tensor [B, ...]):
  QUERY [B, 1] BYTES, REQUEST_OUTPUT_LEN [B, 1] INT32;
  optional DECODER_QUERY [B, 1] BYTES, BAD_WORDS_DICT / STOP_WORDS_DICT [B, W] BYTES,
  EMBEDDING_BIAS_WORDS [B, W] BYTES with EMBEDDING_BIAS_WEIGHTS [B, W] FP32 (each word's
  tokens get its weight), EMBEDDING_BIAS_TOKEN_IDS [B, N] INT32 with
  EMBEDDING_BIAS_TOKEN_WEIGHTS [B, N] FP32 (ours: a bias by token id, as OpenAI's
  `logit_bias`; ids from 0 to the tokenizer's vocabulary size, unique in a row),
  END_ID / PAD_ID [B, 1] INT32 (default: the tokenizer's eos / pad),
  TRUNCATE_PROMPT_TOKENS [B, 1] INT32 (ours, vLLM's truncate_prompt_tokens: only the prompt's
  last N tokens are kept; 0: all).
Outputs:
  INPUT_ID [B, T] INT32 (right-padded with the pad id), REQUEST_INPUT_LEN [B, 1],
  DECODER_INPUT_ID [B, Td], REQUEST_DECODER_INPUT_LEN [B, 1],
  BAD_WORDS_IDS / STOP_WORDS_IDS [B, 2, L] (row 0: concatenated ids padded with 0, row 1: end
  offset of each word padded with -1), EMBEDDING_BIAS [B, V] FP32 ([B, 0] when not given),
  REQUEST_OUTPUT_LEN [B, 1], OUT_END_ID [B, 1], OUT_PAD_ID [B, 1].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from backend.tokenizer import Tokenizer
from backend.triton.errors import RequestError

Tensors = Mapping[str, np.ndarray]


def decode_utf8(value: bytes | str, where: str) -> str:
    """Strict UTF-8; the error names the tensor element and the offending byte."""
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        raise RequestError(
            f"{where} is not valid UTF-8: byte 0x{bad:02x} at offset {exc.start} ({exc.reason})"
        ) from None


def batch_size_of(inputs: Tensors, name: str) -> int:
    tensor = inputs.get(name)
    if tensor is None:
        raise RequestError(f"missing required input {name}")
    if tensor.ndim != 2 or tensor.shape[1] != 1:
        raise RequestError(f"{name} must have shape [batch, 1], got {list(tensor.shape)}")
    return tensor.shape[0]


def column(inputs: Tensors, name: str, batch_size: int, dtype: type) -> np.ndarray | None:
    """An optional [B, 1] tensor, checked for shape and cast to `dtype`."""
    tensor = inputs.get(name)
    if tensor is None:
        return None
    if tensor.shape != (batch_size, 1):
        raise RequestError(f"{name} must have shape [{batch_size}, 1], got {list(tensor.shape)}")
    if tensor.dtype.kind not in "iu":
        raise RequestError(f"{name} must be an integer tensor, got {tensor.dtype}")
    return tensor.astype(dtype)


def word_rows(inputs: Tensors, name: str, batch_size: int) -> list[list[str]] | None:
    """An optional [B, W] BYTES tensor as one list of words per batch item."""
    tensor = inputs.get(name)
    if tensor is None:
        return None
    if tensor.ndim != 2 or tensor.shape[0] != batch_size:
        raise RequestError(f"{name} must have shape [{batch_size}, W], got {list(tensor.shape)}")
    return [
        [decode_utf8(w, f"{name}[{b}][{j}]") for j, w in enumerate(row)]
        for b, row in enumerate(tensor)
    ]


def pad_rows(rows: Sequence[Sequence[int]], pad_value: int) -> np.ndarray:
    """Right-pad ragged rows into an INT32 [len(rows), max_len] array."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad_value, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


class Preprocessor:
    """Turns one request's input tensors into the preprocessing model's output tensors."""

    def __init__(self, tokenizer: Tokenizer, add_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.end_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_id

    def __call__(self, inputs: Tensors) -> dict[str, np.ndarray]:
        batch_size = batch_size_of(inputs, "QUERY")
        keep = column(inputs, "TRUNCATE_PROMPT_TOKENS", batch_size, np.int64)
        if keep is not None and (keep < 0).any():
            raise RequestError("TRUNCATE_PROMPT_TOKENS (truncate_prompt_tokens) must be >= 0 "
                               f"(0: keep the whole prompt), got {keep[:, 0].tolist()}")
        input_ids, input_lens = self.encode_prompts(
            inputs["QUERY"], "QUERY", None if keep is None else keep[:, 0].tolist())
        decoder_ids, decoder_lens = self._decoder_prompts(inputs, batch_size)
        output_len = column(inputs, "REQUEST_OUTPUT_LEN", batch_size, np.int32)
        if output_len is None:
            raise RequestError("missing required input REQUEST_OUTPUT_LEN (max_tokens)")
        if (output_len < 1).any():
            raise RequestError(
                f"REQUEST_OUTPUT_LEN (max_tokens) must be >= 1, got {output_len[:, 0].tolist()}"
            )
        end_id = column(inputs, "END_ID", batch_size, np.int32)
        pad_id = column(inputs, "PAD_ID", batch_size, np.int32)
        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": input_lens,
            "DECODER_INPUT_ID": decoder_ids,
            "REQUEST_DECODER_INPUT_LEN": decoder_lens,
            "BAD_WORDS_IDS": self.word_list(inputs, "BAD_WORDS_DICT", batch_size),
            "STOP_WORDS_IDS": self.word_list(inputs, "STOP_WORDS_DICT", batch_size),
            "EMBEDDING_BIAS": self.embedding_bias(inputs, batch_size),
            "REQUEST_OUTPUT_LEN": output_len,
            "OUT_END_ID": self._fill(end_id, self.end_id, batch_size),
            "OUT_PAD_ID": self._fill(pad_id, self.pad_id, batch_size),
        }

    def encode_prompts(self, query: np.ndarray, name: str, keep: Sequence[int] | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """[B, 1] BYTES -> (ids [B, T] right-padded, lengths [B, 1]); empty prompts are errors;
        `keep`: per row, how many of the last ids to keep (0: all)."""
        rows = []
        for b, value in enumerate(query[:, 0]):
            text = decode_utf8(value, f"{name}[{b}]")
            ids = self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens)
            if not ids:
                raise RequestError(f"{name}[{b}] is empty; the prompt needs at least one token")
            if keep is not None and keep[b]:
                ids = ids[-keep[b]:]
            rows.append(ids)
        lengths = np.array([[len(r)] for r in rows], dtype=np.int32)
        return pad_rows(rows, self.pad_id), lengths

    def word_list(self, inputs: Tensors, name: str, batch_size: int) -> np.ndarray:
        """Stop/bad words in TensorRT-LLM's [B, 2, L] layout; empty words are skipped."""
        words = word_rows(inputs, name, batch_size)
        if words is None:
            return np.zeros((batch_size, 2, 0), dtype=np.int32)
        flat_rows, offset_rows = [], []
        for item_words in words:
            encoded = [self.tokenizer.encode(w) for w in item_words if w]
            encoded = [ids for ids in encoded if ids]
            flat_rows.append([i for ids in encoded for i in ids])
            offset_rows.append(np.cumsum([len(ids) for ids in encoded]).tolist())
        width = max(1, *(len(r) for r in flat_rows))
        flat = pad_rows([r + [0] * (width - len(r)) for r in flat_rows], 0)
        offsets = pad_rows([r + [-1] * (width - len(r)) for r in offset_rows], -1)
        return np.stack([flat, offsets], axis=1)

    def embedding_bias(self, inputs: Tensors, batch_size: int) -> np.ndarray:
        """[B, V] FP32: the words' weights on each of their tokens plus the weights given by
        token id; [B, 0] when neither is given."""
        words = word_rows(inputs, "EMBEDDING_BIAS_WORDS", batch_size)
        weights = inputs.get("EMBEDDING_BIAS_WEIGHTS")
        by_id = self._bias_by_id(inputs, batch_size)
        if (words is None) != (weights is None):
            missing = "EMBEDDING_BIAS_WORDS" if words is None else "EMBEDDING_BIAS_WEIGHTS"
            raise RequestError(f"EMBEDDING_BIAS_WORDS and EMBEDDING_BIAS_WEIGHTS go together; "
                               f"{missing} is missing")
        if words is None and by_id is None:
            return np.zeros((batch_size, 0), dtype=np.float32)
        bias = np.zeros((batch_size, self.tokenizer.vocab_size), dtype=np.float32)
        if words is not None:
            if weights.shape != (batch_size, len(words[0])) or weights.dtype.kind not in "fiu":
                raise RequestError(
                    f"EMBEDDING_BIAS_WEIGHTS shape {list(weights.shape)} {weights.dtype} does "
                    f"not match EMBEDDING_BIAS_WORDS shape {[batch_size, len(words[0])]} (a "
                    f"number per word)"
                )
            if not np.all(np.isfinite(weights)):
                raise RequestError("EMBEDDING_BIAS_WEIGHTS holds a value that is not finite")
            with np.errstate(over="ignore"):  # (checked below)
                for b, (item_words, item_weights) in enumerate(zip(words, weights)):
                    for word, weight in zip(item_words, item_weights):
                        for token_id in self.tokenizer.encode(word):
                            bias[b, token_id] += np.float32(weight)
        if by_id is not None:
            ids, values = by_id
            with np.errstate(over="ignore"):
                np.add.at(bias, (np.arange(batch_size)[:, None], ids), values)
        if not np.all(np.isfinite(bias)):  # (finite weights on one token add up past float32)
            b, token_id = (int(i) for i in np.argwhere(~np.isfinite(bias))[0])
            raise RequestError(f"the embedding bias weights on token {token_id} of request "
                               f"{b} add up to {bias[b, token_id]}, not a finite float32")
        return bias

    def _bias_by_id(self, inputs: Tensors, batch_size: int,
                    ) -> tuple[np.ndarray, np.ndarray] | None:
        ids = inputs.get("EMBEDDING_BIAS_TOKEN_IDS")
        weights = inputs.get("EMBEDDING_BIAS_TOKEN_WEIGHTS")
        if ids is None and weights is None:
            return None
        if ids is None or weights is None:
            missing = "EMBEDDING_BIAS_TOKEN_IDS" if ids is None else "EMBEDDING_BIAS_TOKEN_WEIGHTS"
            raise RequestError(f"EMBEDDING_BIAS_TOKEN_IDS and EMBEDDING_BIAS_TOKEN_WEIGHTS go "
                               f"together; {missing} is missing")
        if ids.ndim != 2 or ids.shape[0] != batch_size or ids.dtype.kind not in "iu":
            raise RequestError(f"EMBEDDING_BIAS_TOKEN_IDS must be an integer tensor of shape "
                               f"[{batch_size}, N], got {list(ids.shape)} {ids.dtype}")
        if weights.shape != ids.shape or weights.dtype.kind != "f":
            raise RequestError(f"EMBEDDING_BIAS_TOKEN_WEIGHTS must be a float tensor of the "
                               f"shape of EMBEDDING_BIAS_TOKEN_IDS {list(ids.shape)}, got "
                               f"{list(weights.shape)} {weights.dtype}")
        vocab = self.tokenizer.vocab_size
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise RequestError(f"EMBEDDING_BIAS_TOKEN_IDS names token ids outside the "
                               f"vocabulary (0..{vocab - 1}): {bad[:5].tolist()}")
        if not np.all(np.isfinite(weights)):
            raise RequestError("EMBEDDING_BIAS_TOKEN_WEIGHTS holds a value that is not finite")
        for b, row in enumerate(ids):
            if len(set(row.tolist())) != len(row):
                raise RequestError(f"EMBEDDING_BIAS_TOKEN_IDS[{b}] names a token id twice")
        return ids.astype(np.int64), weights.astype(np.float32)

    def _decoder_prompts(self, inputs: Tensors, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        # Decoder-only models get a single pad token, as TensorRT-LLM's preprocessing does.
        if inputs.get("DECODER_QUERY") is None:
            ones = np.ones((batch_size, 1), dtype=np.int32)
            return ones * self.pad_id, ones
        if batch_size_of(inputs, "DECODER_QUERY") != batch_size:
            raise RequestError("DECODER_QUERY and QUERY have different batch sizes")
        return self.encode_prompts(inputs["DECODER_QUERY"], "DECODER_QUERY")

    @staticmethod
    def _fill(given: np.ndarray | None, default: int, batch_size: int) -> np.ndarray:
        if given is not None:
            return given
        return np.full((batch_size, 1), default, dtype=np.int32)
