"""Postprocessing: generated token ids -> text, with the tensor contract of TensorRT-LLM's
`inflight_batcher_llm/postprocessing` plus three optional inputs for exact streaming.

Inputs (B = batch, K = beams):
  TOKENS_BATCH [B, K, T] INT32, SEQUENCE_LENGTH [B, K] INT32 (valid ids per beam);
  optional PREFIX_TOKENS [B, K, P] INT32 and PREFIX_LENGTH [B, K] INT32: the tail of the ids
  this stream already returned (valid ids left-aligned), and FLUSH [B, 1] BOOL.
Output:
  OUTPUT [B, K] BYTES (UTF-8).

Without the optional inputs the model is TensorRT-LLM's: OUTPUT = decode(tokens[:len]).
Streaming (why the extra inputs): `hybrid_llm` streams each step's new ids, and a character can
span ids of two responses (up to 4 byte tokens per character). Postprocessing stays stateless,
so the state travels with the request: `hybrid_llm` sends the last DEFAULT_CONTEXT_LEN (8) ids
it already streamed as PREFIX_TOKENS and FLUSH=false except on the final response. OUTPUT is
then `decode_delta(prefix, new)`: the text the new ids add, holding back an unfinished
character until a later response completes it (FLUSH=true emits it as U+FFFD). With a
byte-level tokenizer (its text is its tokens' bytes joined) the delta is computed on the bytes
(`bytes_delta`), and concatenating the streamed OUTPUTs gives the non-streaming text for any
output; otherwise (`decode_delta`, on text) for valid UTF-8 without U+FFFD of its own: see
backend/detokenize.py for the exceptions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from backend.detokenize import bytes_delta, decode_delta
from backend.tokenizer import Tokenizer
from backend.triton.errors import RequestError

Tensors = Mapping[str, np.ndarray]


def beam_tensor(inputs: Tensors, name: str, ndim: int) -> np.ndarray | None:
    tensor = inputs.get(name)
    if tensor is None:
        return None
    if tensor.ndim != ndim:
        dims = ["batch", "beam", "tokens"][:ndim]
        raise RequestError(f"{name} must have shape {dims}, got {list(tensor.shape)}")
    if tensor.dtype.kind not in "iu":
        raise RequestError(f"{name} must be an integer tensor, got {tensor.dtype}")
    return tensor


def lengths_for(inputs: Tensors, name: str, ids: np.ndarray, ids_name: str) -> np.ndarray:
    """[B, K] valid lengths of `ids` [B, K, T]; all of T when the input is absent."""
    lengths = beam_tensor(inputs, name, 2)
    if lengths is None:
        return np.full(ids.shape[:2], ids.shape[2], dtype=np.int64)
    if lengths.shape != ids.shape[:2]:
        raise RequestError(
            f"{name} shape {list(lengths.shape)} does not match {ids_name} "
            f"batch and beams {list(ids.shape[:2])}"
        )
    if (lengths < 0).any() or (lengths > ids.shape[2]).any():
        raise RequestError(
            f"{name} values must lie in [0, {ids.shape[2]}] ({ids_name} width), "
            f"got {lengths.tolist()}"
        )
    return lengths


class Postprocessor:
    """Turns one request's token tensors into OUTPUT text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def __call__(self, inputs: Tensors) -> dict[str, np.ndarray]:
        tokens = beam_tensor(inputs, "TOKENS_BATCH", 3)
        if tokens is None:
            raise RequestError("missing required input TOKENS_BATCH")
        lengths = lengths_for(inputs, "SEQUENCE_LENGTH", tokens, "TOKENS_BATCH")
        prefix = beam_tensor(inputs, "PREFIX_TOKENS", 3)
        if prefix is None:
            prefix = np.zeros((*tokens.shape[:2], 0), dtype=np.int32)
        elif prefix.shape[:2] != tokens.shape[:2]:
            raise RequestError(
                f"PREFIX_TOKENS shape {list(prefix.shape)} does not match TOKENS_BATCH "
                f"batch and beams {list(tokens.shape[:2])}"
            )
        prefix_lengths = lengths_for(inputs, "PREFIX_LENGTH", prefix, "PREFIX_TOKENS")
        flush = self._flush(inputs, tokens.shape[0])
        texts = np.empty(tokens.shape[:2], dtype=np.object_)
        for b, k in np.ndindex(*tokens.shape[:2]):
            new_ids = self._ids(tokens[b, k, : lengths[b, k]], "TOKENS_BATCH")
            prefix_ids = self._ids(prefix[b, k, : prefix_lengths[b, k]], "PREFIX_TOKENS")
            final = bool(flush[b])
            if self.tokenizer.decodes_bytes and (prefix_ids or not final):  # (exact: any bytes)
                text = bytes_delta(self._shown_bytes, prefix_ids, new_ids, final)
            else:  # (on text; a whole output's delta is its decode either way)
                text = decode_delta(self.tokenizer.decode, prefix_ids, new_ids, final,
                                    self.skip_special_tokens)
            texts[b, k] = text.encode("utf-8")
        return {"OUTPUT": texts}

    def _shown_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.shown_bytes(token_id, self.skip_special_tokens)

    @staticmethod
    def _ids(ids: np.ndarray, name: str) -> list[int]:
        """Ids >= the tokenizer's vocabulary decode to nothing, as the tokenizer decodes them:
        a model's embedding table is often padded past its tokenizer (Qwen's 151936 rows for
        151665 tokens) and may sample such an id; an error here, mid-stream, would leave the
        ensemble's request open for good (backend/triton/cancel.py)."""
        bad = ids[(ids < 0) | (ids > np.iinfo(np.int32).max)]
        if bad.size:
            raise RequestError(f"{name} holds ids that are no token ids: {bad[:8].tolist()}")
        return ids.tolist()

    @staticmethod
    def _flush(inputs: Tensors, batch_size: int) -> np.ndarray:
        flush = inputs.get("FLUSH")
        if flush is None:
            return np.ones(batch_size, dtype=bool)
        if flush.shape != (batch_size, 1):
            raise RequestError(f"FLUSH must have shape [{batch_size}, 1], got {list(flush.shape)}")
        return flush[:, 0].astype(bool)
