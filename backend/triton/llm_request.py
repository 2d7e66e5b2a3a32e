"""hybrid_llm inputs -> one engine request, with the tensor contract of TensorRT-LLM's
`inflight_batcher_llm/tensorrt_llm` model (text-only subset) plus `cache_salt` / `session_id`.

A request holds B prompts (Triton's batch dimension, B = 1..max_batch_size; TensorRT-LLM's
batched requests): input_ids [B, T] (rows padded past their input_lengths) and every other
input B rows, the ones below read per row (`batch_items`). Each prompt is one request of its
own to the engine with its row's parameters (`parse_batch`; an error names the row), and its
responses say which with batch_index. The shapes below are one row's (scalars arrive as [1]
or [1, 1] depending on reshape):
  input_ids [1, T] INT32, input_lengths [1] INT32, request_output_len [1] INT32;
  optional end_id, pad_id, runtime_top_k, min_tokens, no_repeat_ngram_size (as TensorRT-LLM's;
  0: off), beam_width, num_return_sequences,
  num_top_log_probs (ours: 0..20, the likeliest tokens to return at each generated position
  with their log probabilities, as vLLM's `logprobs`; implies return_log_probs) [1] INT32;
  temperature, runtime_top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
  len_penalty [1] FP32; seed [1] UINT64; streaming, exclude_input_in_output,
  return_num_input_tokens, return_num_output_tokens, return_log_probs, return_perf_metrics,
  return_context_logits, return_generation_logits, return_prompt_log_probs (ours: each prompt
  token's log probability, and its position's num_top_log_probs likeliest tokens) [1] BOOL;
  early_stopping [1] BOOL (as TensorRT-LLM's; an integer is taken too, nonzero: true);
  stop_words_list / bad_words_list [1, 2, L] INT32 (row 0: the words' ids back to back,
  row 1: the end offset of each word, padded with -1); embedding_bias [1, V] FP32;
  cache_salt, session_id, lora_name (a LoRA adapter of the lora_adapters parameter; none:
  the base model) [1] BYTES (ours); priority [1] INT32 (ours, vLLM's convention: lower
  runs first, default 0; `Request.priority`); guided_decoding_guide_type, guided_decoding_guide
  [1] BYTES (`json`, `json_schema`, `regex`, `ebnf_grammar`, `structural_tag` and the schema /
  regex / grammar / tag, as TensorRT-LLM's; `backend/engine/guided.py`);
  retention_token_range_starts / _ends / _priorities / _durations_ms [1, N] INT32,
  retention_decode_priority / retention_decode_duration_ms [1] INT32: TensorRT-LLM's
  KvCacheRetentionConfig (an end or duration of -1: the prompt's end / never expires;
  `backend/cache/retention.py`);
  allowed_token_ids [1, N] INT32 (vLLM's): only these tokens may be generated (-1 entries
  are padding, for the rows of a batch; none given, or a row of -1 only: every token);
  draft_input_ids [1, N] INT32 (TensorRT-LLM's name): the output the client expects; the
  engine drafts from it as speculative decoding does (`Request.prediction`), the output is
  the model's either way (trailing -1 entries are padding, for the rows of a batch);
  allotted_time_ms [1] UINT64 (TensorRT-LLM's): how long the request may take from its
  arrival; past it, it ends with finish_reason `timed_out` (what it generated is kept;
  checked between steps); 0 or absent: no limit;
  stop [1] BOOL: true cancels the open request whose id is this request's id (as TensorRT-LLM's
  `stop`); its other inputs are ignored.
  load_lora / unload_lora [1] BOOL with lora_name and (load) lora_path [1] BYTES (ours; the
  parameter allow_runtime_lora must be true): adds or removes a LoRA adapter while serving
  (an unload answers dropped_pages); no generation, the other inputs are ignored.
  reset_prefix_cache [1] BOOL (ours): true forgets the cached prefixes on every tier (with
  cache_salt: that namespace's only) and answers dropped_pages / kept_pages [1] INT64 (pages
  running requests hold stay); no generation, the other inputs are ignored.

Penalties, embedding_bias (added to the logits; its non-zero entries become
`SamplingParams.logit_bias`) and return_log_probs are applied as `backend/engine/sampling.py`
states; num_return_sequences K (1..64) asks for K sequences from the one prompt, K engine
requests (`backend/triton/llm_response.py` lays them out).

beam_width W (1..64) > 1 is beam search (`backend/engine/beam.py`): one engine request whose
final output carries its beams (streaming: each step's output, the running beams so far),
ranked by summed log probability over generated length **
len_penalty (`SamplingParams.length_penalty`, default 1.0); early_stopping ends the search once
W beams finished. As in TensorRT-LLM, num_return_sequences then counts beams: absent, all W
are returned; given, it must be in 1..W and the best K are. Beam search is deterministic
(temperature and seed do not apply); top_k / top_p other than neutral and guided decoding are
INVALID_ARG, with `SamplingParams`' message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from backend.cache.retention import DEFAULT_PRIORITY, RetentionConfig, RetentionRange
from backend.engine.guided import Guide
from backend.engine.request import MAX_BEAM_WIDTH, SamplingParams
from backend.triton.errors import RequestError
from backend.triton.tokenize import decode_utf8

Tensors = Mapping[str, np.ndarray]

MAX_RETURN_SEQUENCES = 64


@dataclass(frozen=True)
class LlmRequest:
    """What one hybrid_llm request asks for, validated."""

    prompt_ids: list[int]
    sampling: SamplingParams
    streaming: bool = False
    exclude_input_in_output: bool = True
    cache_salt: str = ""
    session_id: str | None = None
    priority: int = 0  # lower runs first
    lora_name: str | None = None  # a LoRA adapter of the engine's lora_adapters
    # Rows of the response: sequences (K engine requests), or with beam search
    # (sampling.beam_width > 1) the best beams of the one engine request.
    num_return_sequences: int = 1
    return_perf_metrics: bool = False  # the engine's RequestMetrics in each response
    return_context_logits: bool = False  # the prompt's logits (its first sequence's)
    return_generation_logits: bool = False  # each generated token's logits
    return_prompt_log_probs: bool = False  # the prompt tokens' log probabilities (first seq's)
    retention: RetentionConfig | None = None  # the store's priorities for its pages
    prediction: list[int] | None = None  # draft_input_ids: the output it is expected to hold
    allotted_time_ms: int | None = None  # how long it may take from its arrival (None: no limit)

    @property
    def extras(self) -> frozenset[str]:
        """The optional outputs its responses carry (`llm_response.OutputStream`)."""
        return frozenset(name for name, asked in (
            ("perf_metrics", self.return_perf_metrics),
            ("generation_logits", self.return_generation_logits),
            ("context_logits", self.return_context_logits),
            ("top_log_probs", self.sampling.top_log_probs > 0),
            ("prompt_log_probs", self.return_prompt_log_probs)) if asked)

    @property
    def beam_search(self) -> bool:
        return self.sampling.beam_width > 1

    @property
    def num_engine_requests(self) -> int:
        """The engine requests this request runs as: one per sequence, one for a beam
        search."""
        return 1 if self.beam_search else self.num_return_sequences


def batch_items(inputs: Tensors) -> list[Tensors]:
    """A request's prompts, each with its row of every input: input_ids [B, T] holds B
    prompts, and every input B rows (Triton's batch dimension). One prompt: the inputs as
    they are."""
    ids = inputs.get("input_ids")
    if ids is None or ids.ndim != 2 or ids.shape[0] <= 1:
        return [inputs]
    size = ids.shape[0]
    for name, tensor in inputs.items():
        if tensor.ndim == 0 or tensor.shape[0] != size:
            raise RequestError(f"{name} has shape {list(tensor.shape)}: a request of {size} "
                               f"prompts (input_ids {list(ids.shape)}) needs {size} rows of "
                               "every input")
    return [{name: tensor[row:row + 1] for name, tensor in inputs.items()}
            for row in range(size)]


def parse_batch(inputs: Tensors, default_end_id: int | None, exclude_input: bool
                ) -> list[LlmRequest]:
    """Every prompt of a request (`batch_items`), validated; an error in a batch of several
    names the row ("batch item 2: ...")."""
    items = batch_items(inputs)
    if len(items) == 1:
        return [parse_request(items[0], default_end_id, exclude_input)]
    parsed = []
    for row, item in enumerate(items):
        try:
            parsed.append(parse_request(item, default_end_id, exclude_input))
        except RequestError as exc:
            raise RequestError(f"batch item {row}: {exc}") from None
    return parsed


def parse_request(inputs: Tensors, default_end_id: int | None, exclude_input: bool) -> LlmRequest:
    """Validates one prompt's tensors; `RequestError` says what is wrong."""
    prompt_ids = prompt_of(inputs)
    width = int(scalar(inputs, "beam_width", "iu", 1))
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise RequestError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {width}")
    num_sequences = scalar(inputs, "num_return_sequences", "iu", None)
    if width > 1:  # TensorRT-LLM: the best K beams, all of them by default
        num_sequences = width if num_sequences is None else int(num_sequences)
        if not 1 <= num_sequences <= width:
            raise RequestError(f"num_return_sequences={num_sequences} must be in [1, "
                               f"beam_width={width}] with beam search (it counts the beams "
                               "returned)")
    else:
        num_sequences = 1 if num_sequences is None else int(num_sequences)
        if not 1 <= num_sequences <= MAX_RETURN_SEQUENCES:
            raise RequestError(f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], "
                               f"got {num_sequences}")
    return LlmRequest(
        prompt_ids=prompt_ids,
        sampling=sampling_of(inputs, default_end_id, width),
        streaming=bool(scalar(inputs, "streaming", "b", False)),
        exclude_input_in_output=bool(scalar(inputs, "exclude_input_in_output", "b", exclude_input)),
        cache_salt=text_of(inputs, "cache_salt") or "",
        session_id=text_of(inputs, "session_id") or None,
        priority=int(scalar(inputs, "priority", "iu", 0)),
        lora_name=text_of(inputs, "lora_name") or None,
        num_return_sequences=num_sequences,
        return_perf_metrics=bool(scalar(inputs, "return_perf_metrics", "b", False)),
        return_context_logits=bool(scalar(inputs, "return_context_logits", "b", False)),
        return_generation_logits=bool(scalar(inputs, "return_generation_logits", "b", False)),
        return_prompt_log_probs=bool(scalar(inputs, "return_prompt_log_probs", "b", False)),
        retention=retention_of(inputs),
        prediction=_unpadded(int_vector(inputs, "draft_input_ids")) or None,
        allotted_time_ms=allotted_time_of(inputs),
    )


def _unpadded(values: list[int] | None) -> list[int] | None:
    """A row of a batched vector without its trailing -1 padding."""
    end = len(values or ())
    while end and values[end - 1] == -1:
        end -= 1
    return values[:end] if values else values


# A day: more is surely a unit mistake (allotted_time_ms counts milliseconds)
MAX_ALLOTTED_TIME_MS = 86_400_000


def allotted_time_of(inputs: Tensors) -> int | None:
    """allotted_time_ms: None for absent or 0 (no limit); RequestError past a day."""
    value = scalar(inputs, "allotted_time_ms", "iu", None)
    if value is None or int(value) == 0:
        return None
    if not 0 < int(value) <= MAX_ALLOTTED_TIME_MS:
        raise RequestError(f"allotted_time_ms must be in [0, {MAX_ALLOTTED_TIME_MS}] (0: no "
                           f"limit), got {int(value)}")
    return int(value)


def is_stop(inputs: Tensors) -> bool:
    return bool(scalar(inputs, "stop", "b", False))


def lora_update_of(inputs: Tensors) -> tuple[str, str, str | None] | None:
    """`load_lora` / `unload_lora` = true: ("load" | "unload", the adapter's name, its path
    for a load), else None; RequestError for a request that says neither well."""
    load = bool(scalar(inputs, "load_lora", "b", False))
    unload = bool(scalar(inputs, "unload_lora", "b", False))
    if not (load or unload):
        return None
    if load and unload:
        raise RequestError("load_lora and unload_lora are both true: one at a time")
    name = text_of(inputs, "lora_name")
    if not name:
        raise RequestError(f"{'load_lora' if load else 'unload_lora'} needs lora_name")
    path = text_of(inputs, "lora_path")
    if load and not path:
        raise RequestError("load_lora needs lora_path (the adapter's folder on the server)")
    return ("load" if load else "unload"), name, path


def cache_reset_of(inputs: Tensors) -> tuple[str | None, bool] | None:
    """`reset_prefix_cache` = true: (the namespace, whether every namespace), else None."""
    if not scalar(inputs, "reset_prefix_cache", "b", False):
        return None
    if "cache_salt" not in inputs:
        return None, True
    return text_of(inputs, "cache_salt") or "", False


def prompt_of(inputs: Tensors) -> list[int]:
    ids = inputs.get("input_ids")
    if ids is None:
        raise RequestError("missing required input input_ids")
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids must be an integer tensor, got {ids.dtype}")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise RequestError(f"input_ids must have shape [B, T] (B prompts of up to T ids), got "
                           f"{list(ids.shape)}")
    length = scalar(inputs, "input_lengths", "iu", ids.shape[1])
    if not 0 <= length <= ids.shape[1]:
        raise RequestError(
            f"input_lengths={length} is outside [0, {ids.shape[1]}] (input_ids width)"
        )
    if length == 0:
        raise RequestError("the prompt is empty; it needs at least one token")
    return ids[0, :length].tolist()  # Python ints (a loop of int() is 20x slower)


def sampling_of(inputs: Tensors, default_end_id: int | None, beam_width: int = 1
                ) -> SamplingParams:
    max_tokens = scalar(inputs, "request_output_len", "iu", None)
    if max_tokens is None:
        raise RequestError("missing required input request_output_len (max_tokens)")
    seed = scalar(inputs, "seed", "iu", None)
    try:
        return SamplingParams(
            max_tokens=int(max_tokens),
            min_tokens=int(scalar(inputs, "min_tokens", "iu", 0)),
            temperature=finite(inputs, "temperature", 1.0),
            top_k=int(scalar(inputs, "runtime_top_k", "iu", 0)),
            top_p=finite(inputs, "runtime_top_p", 1.0),
            min_p=finite(inputs, "min_p", 0.0),
            seed=None if seed is None else int(seed),
            end_id=int(scalar(inputs, "end_id", "iu", default_end_id)),
            stop_words=words_of(inputs, "stop_words_list"),
            bad_words=words_of(inputs, "bad_words_list"),
            repetition_penalty=finite(inputs, "repetition_penalty", 1.0),
            presence_penalty=finite(inputs, "presence_penalty", 0.0),
            frequency_penalty=finite(inputs, "frequency_penalty", 0.0),
            logit_bias=bias_of(inputs),
            allowed_token_ids=tuple(dict.fromkeys(
                t for t in int_vector(inputs, "allowed_token_ids") or () if t != -1)),
            no_repeat_ngram_size=int(scalar(inputs, "no_repeat_ngram_size", "iu", 0)),
            return_log_probs=bool(scalar(inputs, "return_log_probs", "b", False)),
            top_log_probs=int(scalar(inputs, "num_top_log_probs", "iu", 0)),
            guide=guide_of(inputs),
            beam_width=beam_width,
            length_penalty=finite(inputs, "len_penalty", 1.0),
            early_stopping=bool(scalar(inputs, "early_stopping", "iub", False)),
        )
    except ValueError as exc:  # SamplingParams states the bad value (by the input's name)
        raise RequestError(re.sub(r"(?<![\w.])top_log_probs\b", "num_top_log_probs",
                                  str(exc))) from None


def guide_of(inputs: Tensors) -> Guide | None:
    """guided_decoding_guide_type (empty or absent: unguided) and guided_decoding_guide."""
    kind = (text_of(inputs, "guided_decoding_guide_type") or "").strip()
    text = text_of(inputs, "guided_decoding_guide") or ""
    if not kind:
        if text.strip():
            raise RequestError("guided_decoding_guide is set but guided_decoding_guide_type is "
                               "not (json, json_schema, regex, ebnf_grammar or structural_tag)")
        return None
    return Guide(kind, text)  # ValueError: caught by sampling_of


def scalar(inputs: Tensors, name: str, kinds: str, default: object) -> object:
    """The one value of an optional per-request tensor, checked for dtype kind."""
    tensor = inputs.get(name)
    if tensor is None:
        return default
    if tensor.size != 1:
        raise RequestError(
            f"{name} must hold one value per request, got shape {list(tensor.shape)}"
        )
    if tensor.dtype.kind not in kinds:
        raise RequestError(f"{name} has dtype {tensor.dtype}, expected kind {kinds!r}")
    return tensor.reshape(-1)[0].item()


RANGE_INPUTS = ("retention_token_range_starts", "retention_token_range_ends",
                "retention_token_range_priorities", "retention_token_range_durations_ms")


def retention_of(inputs: Tensors) -> RetentionConfig | None:
    """TensorRT-LLM's retention inputs -> `RetentionConfig` (None when none is given). Ranges
    need starts, ends and priorities of one length (durations optional, same length); -1
    ends a range at the prompt's end, and a duration of -1 never expires (as absent)."""
    starts, ends, priorities, durations = (int_vector(inputs, n) for n in RANGE_INPUTS)
    decode_priority = scalar(inputs, "retention_decode_priority", "iu", None)
    decode_ms = scalar(inputs, "retention_decode_duration_ms", "iu", None)
    if starts is None and decode_priority is None and decode_ms is None:
        given = [n for n, v in zip(RANGE_INPUTS[1:], (ends, priorities, durations))
                 if v is not None]
        if given:
            raise RequestError(f"{given[0]} needs retention_token_range_starts")
        return None
    ranges = []
    if starts is not None:
        for name, values in zip(RANGE_INPUTS[1:], (ends, priorities, durations)):
            if values is None and name != RANGE_INPUTS[3]:
                raise RequestError(f"retention_token_range_starts needs {name}")
            if values is not None and len(values) != len(starts):
                raise RequestError(f"{name} has {len(values)} values, "
                                   f"retention_token_range_starts {len(starts)}")
        durations = durations or [-1] * len(starts)
    try:
        for start, end, priority, ms in zip(starts or (), ends or (), priorities or (),
                                            durations or ()):
            ranges.append(RetentionRange(start, None if end == -1 else end, priority,
                                         duration_of(ms)))
        return RetentionConfig(
            ranges=tuple(ranges),
            decode_priority=DEFAULT_PRIORITY if decode_priority is None else int(decode_priority),
            decode_duration_s=None if decode_ms is None else duration_of(int(decode_ms)))
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def duration_of(ms: int) -> float | None:
    """Milliseconds (-1: never expires) -> seconds."""
    if ms == -1:
        return None
    if ms < 0:
        raise RequestError(f"a retention duration must be >= 0 ms (-1: never expires), "
                           f"got {ms}")
    return ms / 1000


def int_vector(inputs: Tensors, name: str) -> list[int] | None:
    """An optional [1, N] (or [N]) integer tensor -> its N values."""
    tensor = inputs.get(name)
    if tensor is None:
        return None
    if tensor.dtype.kind not in "iu" or tensor.ndim not in (1, 2) or \
            (tensor.ndim == 2 and tensor.shape[0] != 1):
        raise RequestError(f"{name} must be an integer tensor of shape [1, N], got "
                           f"{list(tensor.shape)} {tensor.dtype}")
    return [int(v) for v in tensor.reshape(-1)]


def finite(inputs: Tensors, name: str, default: float = 0.0) -> float:
    value = float(scalar(inputs, name, "fiu", default))
    if not math.isfinite(value):
        raise RequestError(f"{name} must be finite, got {value}")
    return value


def bias_of(inputs: Tensors) -> tuple[tuple[int, float], ...]:
    """embedding_bias [1, V] (or [V]; [1, 0] when not given) -> its non-zero entries as
    (token id, value) pairs; the engine checks the ids against the vocabulary."""
    bias = inputs.get("embedding_bias")
    if bias is None or bias.size == 0:
        return ()
    if bias.dtype.kind != "f" or bias.ndim not in (1, 2) or (bias.ndim == 2 and bias.shape[0] != 1):
        raise RequestError(f"embedding_bias must be a float tensor of shape [1, V], got "
                           f"{list(bias.shape)} {bias.dtype}")
    row = bias.reshape(-1)
    if not np.all(np.isfinite(row)):
        raise RequestError("embedding_bias holds a value that is not finite")
    ids = np.flatnonzero(row)
    return tuple((int(i), float(row[i])) for i in ids)


def words_of(inputs: Tensors, name: str) -> tuple[tuple[int, ...], ...]:
    """TensorRT-LLM's [1, 2, L] word list -> tuple of words (tuples of ids)."""
    tensor = inputs.get(name)
    if tensor is None or tensor.size == 0:
        return ()
    if tensor.ndim == 2:
        tensor = tensor[None]
    if tensor.ndim != 3 or tensor.shape[:2] != (1, 2) or tensor.dtype.kind not in "iu":
        raise RequestError(
            f"{name} must be an integer tensor of shape [1, 2, L], got {list(tensor.shape)} "
            f"{tensor.dtype}"
        )
    flat, offsets = tensor[0, 0].tolist(), tensor[0, 1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if not start < end <= len(flat):
            raise RequestError(f"{name} has a bad word end offset {end} (after {start})")
        words.append(tuple(flat[start:end]))
        start = end
    return tuple(words)


def text_of(inputs: Tensors, name: str) -> str | None:
    tensor = inputs.get(name)
    if tensor is None:
        return None
    if tensor.size != 1:
        raise RequestError(
            f"{name} must hold one string per request, got shape {list(tensor.shape)}"
        )
    return decode_utf8(tensor.reshape(-1)[0], name)
