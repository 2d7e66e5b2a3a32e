"""Engine outputs -> hybrid_llm response tensors (TensorRT-LLM's `tensorrt_llm` outputs, ours,
and the three tensors that keep streamed detokenization exact in `postprocessing`).

Every response carries every output, because an ensemble only answers an iteration once all of
its requested outputs arrived for it:
  output_ids [1, 1, T] INT32, sequence_length [1, 1] INT32 (batch, beam),
  num_input_tokens, num_output_tokens, cached_tokens, replayed_anchors, recomputed_tokens
  [1, 1] INT32, prefix_ids [1, 1, P] INT32, prefix_length [1, 1] INT32, flush [1, 1] BOOL,
  output_log_probs [1, 1, N] FP32 and cum_log_probs [1, 1] FP32 (TensorRT-LLM's; with
  return_log_probs: the model's log probability of each generated id in this response and
  their running sum; without it, N = 0 and the sum 0).

Streaming: one response per engine step that produced tokens; output_ids holds only that
step's ids (never the prompt) and num_output_tokens their count, so a client summing it gets the
total (as Triton's OpenAI frontend does). prefix_ids are the last PREFIX_LEN ids already streamed
and flush is true on the final response only (see backend/triton/README.md).
Non-streaming: one final response with all generated ids, after the prompt unless
exclude_input_in_output; num_output_tokens is the total.
"""

from __future__ import annotations

import numpy as np

from backend.detokenize import DEFAULT_CONTEXT_LEN
from backend.engine.request import RequestOutput

PREFIX_LEN = DEFAULT_CONTEXT_LEN
Tensors = dict[str, np.ndarray]


class OutputStream:
    """Per-request state between engine outputs and responses."""

    def __init__(
        self, request_key: str, prompt_ids: list[int], streaming: bool, exclude_input: bool
    ) -> None:
        self.request_key = request_key
        self.prompt_ids = prompt_ids
        self.streaming = streaming
        self.exclude_input = exclude_input
        self.generated: list[int] = []  # streamed so far (streaming) or collected (otherwise)
        self.log_probs: list[float] = []  # collected (not streaming, return_log_probs)

    def on_output(self, out: RequestOutput) -> Tensors | None:
        """The tensors to send for `out`, or None when nothing is due yet."""
        if self.streaming:
            if not out.new_token_ids and not out.finished:
                return None
            prefix = self.generated[-PREFIX_LEN:]
            self.generated.extend(out.new_token_ids)
            return self._tensors(out, out.new_token_ids, prefix, len(out.new_token_ids),
                                 out.log_probs)
        self.generated.extend(out.new_token_ids)
        self.log_probs.extend(out.log_probs)
        if not out.finished:
            return None
        ids = self.generated if self.exclude_input else self.prompt_ids + self.generated
        return self._tensors(out, ids, [], len(self.generated), self.log_probs)

    def _tensors(
        self, out: RequestOutput, ids: list[int], prefix: list[int], num_output_tokens: int,
        log_probs: list[float],
    ) -> Tensors:
        return response_tensors(out, ids, prefix, num_output_tokens, self.request_key,
                                log_probs)


def response_tensors(
    out: RequestOutput, ids: list[int], prefix: list[int], num_output_tokens: int, key: str,
    log_probs: list[float],
) -> Tensors:
    return {
        "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": _int32(len(ids)),
        "num_input_tokens": _int32(out.num_input_tokens),
        "num_output_tokens": _int32(num_output_tokens),
        "cached_tokens": _int32(out.cached_tokens),
        "replayed_anchors": _int32(out.replayed_anchors),
        "recomputed_tokens": _int32(out.recomputed_tokens),
        "prefix_ids": np.array(prefix, dtype=np.int32).reshape(1, 1, -1),
        "prefix_length": _int32(len(prefix)),
        "flush": np.array([[out.finished]], dtype=np.bool_),
        "request_key": np.array([[key.encode("utf-8")]], dtype=np.object_),
        "output_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, 1, -1),
        "cum_log_probs": np.array([[out.cum_log_prob]], dtype=np.float32),
    }


def _int32(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)
