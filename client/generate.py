"""Talking to the `ensemble` model: gRPC streaming (tritonclient) and HTTP generate endpoints.

`GenerateParams` holds what a request asks for, in the ensemble's input names. `stream_grpc`
and `stream_http` yield `Chunk`s as they arrive; `generate_http` returns one final `Chunk`;
`stream_grpc_batch` sends several prompts as one batched request.
Errors from the server raise `GenerateError` carrying its status and message.
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODEL = "ensemble"
ENGINE_MODEL = "hybrid_llm"  # what the ensemble runs; reset_prefix_cache goes to it directly
RESET_COUNTS = ("dropped_pages", "kept_pages")
# hybrid_llm's required inputs, as a control request (reset, LoRA updates) fills them.
_CONTROL = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.ones((1, 1), np.int32),
            "request_output_len": np.ones((1, 1), np.int32)}
COUNTS = (
    "num_input_tokens",
    "num_output_tokens",
    "cached_tokens",
    "replayed_anchors",
    "recomputed_tokens",
)
# With return_perf_metrics (TensorRT-LLM's names): KV blocks and draft tokens, wall-clock times
# in ns, the drafts' acceptance rate.
PERF_METRICS = (
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)


@dataclass(frozen=True)
class GenerateParams:
    prompt: str
    max_tokens: int = 64
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    stop_words: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()
    num_return_sequences: int | None = None
    # Beam search (beam_width > 1): num_return_sequences then counts the beams returned
    # (all of them when unset).
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    no_repeat_ngram_size: int | None = None  # no n-gram of the text so far comes again
    allowed_token_ids: tuple[int, ...] = ()  # only these tokens are generated (vLLM's)
    return_log_probs: bool | None = None
    num_top_log_probs: int | None = None  # the N likeliest tokens at each position (0..20)
    return_prompt_log_probs: bool | None = None  # each prompt token's, and its alternatives
    return_perf_metrics: bool | None = None
    return_context_logits: bool | None = None
    return_generation_logits: bool | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    priority: int | None = None  # scheduling: lower runs first (default 0)
    allotted_time_ms: int | None = None  # past it (from arrival) the request ends: timed_out
    lora_name: str | None = None  # a LoRA adapter the server loaded (lora_adapters)
    # KV cache retention (TensorRT-LLM's KvCacheRetentionConfig): (start, end, priority,
    # duration_ms) per prompt token range (end / duration -1: the prompt's end / forever),
    # and the priority / duration_ms of the pages holding generated tokens.
    retention_ranges: tuple[tuple[int, int, int, int], ...] = ()
    retention_decode_priority: int | None = None
    retention_decode_duration_ms: int | None = None
    exclude_input_in_output: bool | None = None
    # Guided decoding: "json", "json_schema", "regex" or "ebnf_grammar", and the schema / regex /
    # grammar text (none for "json").
    guide_type: str | None = None
    guide: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more ensemble inputs, as given

    def fields(self, stream: bool) -> dict[str, Any]:
        """Ensemble inputs by name (unset options left out)."""
        values: dict[str, Any] = {
            "text_input": self.prompt,
            "max_tokens": self.max_tokens,
            "stream": stream,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "stop_words": list(self.stop_words) or None,
            "bad_words": list(self.bad_words) or None,
            "num_return_sequences": self.num_return_sequences,
            "beam_width": self.beam_width,
            "length_penalty": self.length_penalty,
            "early_stopping": None if self.early_stopping is None else bool(self.early_stopping),
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "allowed_token_ids": list(self.allowed_token_ids) or None,
            "return_log_probs": self.return_log_probs,
            "num_top_log_probs": self.num_top_log_probs,
            "return_prompt_log_probs": self.return_prompt_log_probs,
            "return_perf_metrics": self.return_perf_metrics,
            "return_context_logits": self.return_context_logits,
            "return_generation_logits": self.return_generation_logits,
            "cache_salt": self.cache_salt,
            "session_id": self.session_id,
            "priority": self.priority,
            "allotted_time_ms": self.allotted_time_ms,
            "lora_name": self.lora_name,
            "exclude_input_in_output": self.exclude_input_in_output,
            "guided_decoding_guide_type": self.guide_type,
            "guided_decoding_guide": self.guide,
            "retention_decode_priority": self.retention_decode_priority,
            "retention_decode_duration_ms": self.retention_decode_duration_ms,
        }
        if self.retention_ranges:
            columns = [list(c) for c in zip(*self.retention_ranges)]
            values.update(zip(RETENTION_RANGE_INPUTS, columns))
        values.update(self.extra)
        return {name: value for name, value in values.items() if value is not None}


@dataclass
class Chunk:
    """One response: its text, counts, and seconds since the request was sent; with
    return_log_probs, the log probability of each token it carries and their running sum.

    With num_return_sequences K > 1, `texts` has one text per sequence (`text` joins them) and
    `sequence_index` says which sequence a streamed response carries (-1: all of them, the
    non-streamed response, and a beam search's one response, whose rows are its beams, best
    first); `log_probs` / `cum_log_prob` are that sequence's, and
    `log_probs_by_sequence` / `cum_log_probs` every row as sent (rows padded with zeros to the
    longest). `finish_reasons` holds, per row, why that sequence ended ("eos", "stop",
    "length", "timed_out", "cancelled") on the response that ends it, "" before (empty: not
    sent)."""

    text: str
    elapsed_s: float
    counts: dict[str, int] = field(default_factory=dict)
    final: bool = False
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float | None = None
    texts: list[str] = field(default_factory=list)
    sequence_index: int = 0
    log_probs_by_sequence: list[list[float]] = field(default_factory=list)
    cum_log_probs: list[float] = field(default_factory=list)
    perf: dict[str, float] = field(default_factory=dict)  # PERF_METRICS, where sent
    finish_reasons: list[str] = field(default_factory=list)
    # With return_generation_logits / return_context_logits: the server's tensors without
    # their batch dimension over gRPC ([K, T, V] and [P, V]); HTTP's JSON holds them flat.
    generation_logits: np.ndarray | None = None
    context_logits: np.ndarray | None = None
    # With num_top_log_probs = N: the N likeliest tokens at each position a row carries and
    # their log probabilities, [K, T, N] over gRPC (ids padded with -1), flat over HTTP.
    top_log_prob_ids: np.ndarray | None = None
    top_log_probs: np.ndarray | None = None
    # With return_prompt_log_probs, on the response that carries them (else empty): the
    # prompt's ids, each prompt token's log probability after the first, and (with
    # num_top_log_probs) its position's alternatives [P - 1, N] over gRPC, flat over HTTP.
    prompt_token_ids: np.ndarray | None = None
    prompt_log_probs: np.ndarray | None = None
    prompt_log_prob_ranks: np.ndarray | None = None
    prompt_top_log_prob_ids: np.ndarray | None = None
    prompt_top_log_probs: np.ndarray | None = None
    # Which prompt of a batched request (`stream_grpc_batch`) the response answers.
    batch_index: int = 0


def make_chunk(texts: list[str], elapsed_s: float, counts: dict[str, int], final: bool,
               log_probs: Any = None, cum: Any = None, index: Any = None,
               perf: dict[str, float] | None = None, reasons: Any = None) -> Chunk:
    """A Chunk from a response's outputs (flat arrays, or None where an output is absent)."""
    index = 0 if index is None else int(np.ravel(index)[0])
    chunk = Chunk("".join(texts), elapsed_s, counts, final, texts=texts, sequence_index=index,
                  perf=perf or {})
    if reasons is not None:
        chunk.finish_reasons = [r.decode("utf-8") if isinstance(r, bytes) else str(r)
                                for r in np.ravel(reasons)]
    row = max(index, 0)
    if log_probs is not None and texts:
        rows = np.asarray(log_probs, dtype=np.float64).reshape(len(texts), -1).tolist()
        chunk.log_probs_by_sequence = rows
        chunk.log_probs = rows[row] if index >= 0 or len(rows) == 1 else []
    if cum is not None:
        chunk.cum_log_probs = [float(v) for v in np.ravel(cum)]
        chunk.cum_log_prob = chunk.cum_log_probs[row] if chunk.cum_log_probs else None
    return chunk


class GenerateError(RuntimeError):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


PROMPT_SCORES = ("prompt_token_ids", "prompt_log_probs", "prompt_log_prob_ranks",
                 "prompt_top_log_prob_ids", "prompt_top_log_probs")
RETENTION_RANGE_INPUTS = ("retention_token_range_starts", "retention_token_range_ends",
                          "retention_token_range_priorities",
                          "retention_token_range_durations_ms")

# Input dtypes of the ensemble (model_repo/ensemble/config.pbtxt).
DTYPES = {
    **dict.fromkeys(RETENTION_RANGE_INPUTS, "INT32"),
    "draft_input_ids": "INT32",
    "allowed_token_ids": "INT32",
    "retention_decode_priority": "INT32",
    "retention_decode_duration_ms": "INT32",
    "text_input": "BYTES",
    "stop_words": "BYTES",
    "bad_words": "BYTES",
    "cache_salt": "BYTES",
    "session_id": "BYTES",
    "lora_name": "BYTES",
    "guided_decoding_guide_type": "BYTES",
    "guided_decoding_guide": "BYTES",
    "embedding_bias_words": "BYTES",
    "max_tokens": "INT32",
    "top_k": "INT32",
    "min_tokens": "INT32",
    "no_repeat_ngram_size": "INT32",
    "priority": "INT32",
    "allotted_time_ms": "UINT64",
    "truncate_prompt_tokens": "INT32",
    "end_id": "INT32",
    "pad_id": "INT32",
    "beam_width": "INT32",
    "num_return_sequences": "INT32",
    "seed": "UINT64",
    "temperature": "FP32",
    "top_p": "FP32",
    "min_p": "FP32",
    "length_penalty": "FP32",
    "repetition_penalty": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    "embedding_bias_weights": "FP32",
    "embedding_bias_token_ids": "INT32",
    "embedding_bias_token_weights": "FP32",
    "stream": "BOOL",
    "early_stopping": "BOOL",
    "exclude_input_in_output": "BOOL",
    "return_log_probs": "BOOL",
    "num_top_log_probs": "INT32",
    "return_prompt_log_probs": "BOOL",
    "return_perf_metrics": "BOOL",
    "return_context_logits": "BOOL",
    "return_generation_logits": "BOOL",
    "return_num_input_tokens": "BOOL",
    "return_num_output_tokens": "BOOL",
}
NP_DTYPES = {
    "BYTES": np.object_,
    "INT32": np.int32,
    "UINT64": np.uint64,
    "FP32": np.float32,
    "BOOL": np.bool_,
}


def as_array(name: str, value: Any) -> np.ndarray:
    """[1, 1] (or [1, W] for word lists) with the ensemble's dtype for `name`."""
    dtype = NP_DTYPES[DTYPES.get(name, "BYTES")]
    values = value if isinstance(value, (list, tuple)) else [value]
    if dtype is np.object_:
        values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    return np.array([values], dtype=dtype)


def grpc_inputs(fields: dict[str, Any]) -> list:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in fields.items():
        if isinstance(value, np.ndarray):  # as given (tests send wrong dtypes on purpose)
            array, dtype = value, np_to_triton_dtype(value.dtype)
        else:
            array, dtype = as_array(name, value), DTYPES.get(name, "BYTES")
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream_grpc(
    url: str,
    params: GenerateParams,
    stream: bool = True,
    model: str = MODEL,
    timeout_s: float = 300.0,
) -> Iterator[Chunk]:
    """Streams one request over gRPC; closing the iterator early cancels the request. Every
    failure (the server's, a broken stream, no response within `timeout_s`) raises
    `GenerateError`."""
    yield from _grpc_chunks(url, model, grpc_inputs(params.fields(stream)), timeout_s)


def stream_grpc_batch(
    url: str,
    params: Sequence[GenerateParams],
    stream: bool = True,
    model: str = MODEL,
    timeout_s: float = 300.0,
) -> Iterator[Chunk]:
    """Several prompts as one batched request (input tensors of B rows, as TensorRT-LLM's
    batched requests): every prompt's chunks, interleaved as they come, each naming its prompt
    in `batch_index` (not streaming: one chunk per prompt as it ends); only the last is
    final. Every prompt must set the same options (`batch_inputs`). Failures, one prompt's
    included, raise `GenerateError`; closing the iterator early cancels every prompt."""
    yield from _grpc_chunks(url, model, grpc_inputs(batch_inputs(params, stream)), timeout_s)


# List inputs whose rows the server reads with -1 as padding: a batch's rows of them are
# padded to the longest, and a prompt without one gets a row of -1 (meaning none).
PADDED_INPUTS = ("allowed_token_ids",)


def batch_inputs(params: Sequence[GenerateParams], stream: bool) -> dict[str, np.ndarray]:
    """The ensemble inputs of one batched request: row b of each is `params[b]`'s. A tensor
    has one shape for all rows, so every prompt sets the same options, and lists (stop words,
    bad words, retention ranges) of one length, but for PADDED_INPUTS (padded with -1);
    ValueError says which differs."""
    if not params:
        raise ValueError("a batched request needs at least one prompt")
    fields = [p.fields(stream) for p in params]
    for name in PADDED_INPUTS:
        rows = [f.get(name) for f in fields]
        if all(r is None for r in rows) or any(isinstance(r, np.ndarray) for r in rows):
            continue  # none set, or tensors given as they are
        width = max(len(r or ()) for r in rows)
        for f, row in zip(fields, rows):
            f[name] = list(row or ()) + [-1] * (width - len(row or ()))
    for b, f in enumerate(fields[1:], 1):
        if set(f) != set(fields[0]):
            raise ValueError(f"prompt {b} sets {sorted(set(f) ^ set(fields[0]))} and prompt 0 "
                             "does not, or the other way round: a batched request's prompts "
                             "set the same options")
    arrays = {}
    for name in fields[0]:
        rows = [f[name] if isinstance(f[name], np.ndarray) else as_array(name, f[name])
                for f in fields]
        shapes = sorted({r.shape for r in rows})
        if len(shapes) > 1:
            raise ValueError(f"the prompts' {name} differ in shape {shapes}: a batched "
                             "request's rows of one input have one shape")
        arrays[name] = np.concatenate(rows)
    return arrays


def _grpc_chunks(url: str, model: str, inputs: list, timeout_s: float) -> Iterator[Chunk]:
    start = time.perf_counter()
    results = grpc_results(url, model, inputs, timeout_s)
    with contextlib.closing(results):  # closed early: the request is cancelled at once
        for result in results:
            chunk = grpc_chunk(result, time.perf_counter() - start)
            if chunk.text or chunk.counts or chunk.final:
                yield chunk


def grpc_results(url: str, model: str, inputs: list, timeout_s: float) -> Iterator[Any]:
    """One request's responses (tritonclient results) over a gRPC stream, up to and
    including its final one; closing the iterator early cancels the request. Failures raise
    `GenerateError`."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False
    try:
        try:
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        except InferenceServerException as exc:  # the stream broke before the request went
            finished = True
            try:  # its callback holds why (e.g. connection refused), the exception does not
                _, cause = responses.get(timeout=1.0)
            except queue.Empty:
                cause = None
            exc = cause if isinstance(cause, InferenceServerException) else exc
            raise GenerateError(grpc_status(exc), exc.message()) from None
        while not finished:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise GenerateError("timeout", f"no response within {timeout_s} s") from None
            if error is not None:
                finished = True
                raise GenerateError(grpc_status(error), error.message())
            finished = result.get_response().parameters["triton_final_response"].bool_param
            yield result
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


def update_lora(url: str, action: str, name: str, path: str | None = None,
                timeout_s: float = 120.0) -> dict[str, int]:
    """Loads (`action` "load", the adapter's folder on the server at `path`) or unloads
    ("unload") LoRA adapter `name` on a server whose hybrid_llm allows it
    (`allow_runtime_lora`); an unload returns {"dropped_pages"}. Failures raise
    `GenerateError`."""
    if action not in ("load", "unload"):
        raise ValueError(f"action must be load or unload, got {action!r}")
    fields: dict[str, Any] = {**_CONTROL, f"{action}_lora": np.ones((1, 1), np.bool_),
                              "lora_name": np.array([[name.encode("utf-8")]], np.object_)}
    if path is not None:
        fields["lora_path"] = np.array([[str(path).encode("utf-8")]], np.object_)
    return _control(url, fields, timeout_s)


def _control(url: str, fields: dict[str, Any], timeout_s: float) -> dict[str, int]:
    """A control request to the engine model: the counts (RESET_COUNTS) its answer carries."""
    counts: dict[str, int] = {}
    for result in grpc_results(url, ENGINE_MODEL, grpc_inputs(fields), timeout_s):
        names = {o.name for o in result.get_response().outputs}
        counts.update({n: int(result.as_numpy(n).reshape(-1)[0]) for n in RESET_COUNTS
                       if n in names})
    return counts


def reset_prefix_cache(url: str, cache_salt: str | None = None,
                       timeout_s: float = 60.0) -> dict[str, int]:
    """Asks the server's engine model to forget its cached prefixes on every tier (with
    `cache_salt`: that namespace's only); pages running requests hold stay. Returns
    {"dropped_pages", "kept_pages"}; failures raise `GenerateError`."""
    fields: dict[str, Any] = {**_CONTROL, "reset_prefix_cache": np.ones((1, 1), np.bool_)}
    if cache_salt is not None:
        fields["cache_salt"] = np.array([[cache_salt.encode("utf-8")]], dtype=np.object_)
    counts = _control(url, fields, timeout_s)
    if set(counts) != set(RESET_COUNTS):
        raise GenerateError("no result", "the server answered without dropped_pages / "
                            "kept_pages (does its hybrid_llm take reset_prefix_cache?)")
    return counts


def grpc_status(error: Any) -> str:
    # Errors inside a gRPC stream come as messages only, without a status code.
    status = error.status() if hasattr(error, "status") else None
    return str(status or "gRPC stream error")


def grpc_chunk(result: Any, elapsed_s: float) -> Chunk:
    response = result.get_response()
    final = response.parameters["triton_final_response"].bool_param
    names = {o.name for o in response.outputs}

    def output(name: str) -> Any:
        return result.as_numpy(name).reshape(-1) if name in names else None

    texts = [t.decode("utf-8") for t in output("text_output")] if "text_output" in names else []
    counts = {n: int(output(n)[0]) for n in COUNTS if n in names}
    perf = {n: output(n)[0].item() for n in PERF_METRICS if n in names}
    chunk = make_chunk(texts, elapsed_s, counts, final, output("output_log_probs"),
                       output("cum_log_probs"), output("sequence_index"), perf,
                       output("finish_reason"))
    for name in ("generation_logits", "context_logits", "top_log_probs", "top_log_prob_ids",
                 *PROMPT_SCORES):
        if name in names:
            setattr(chunk, name, result.as_numpy(name)[0])
    if "batch_index" in names:
        chunk.batch_index = int(output("batch_index")[0])
    return chunk


def generate_http(
    url: str, params: GenerateParams, model: str = MODEL, timeout_s: float = 300.0
) -> Chunk:
    """POST /v2/models/<model>/generate: one response with the whole text."""
    start = time.perf_counter()
    with _post(f"{url}/v2/models/{model}/generate", params.fields(False), timeout_s) as resp:
        body = json.loads(resp.read())
    return http_chunk(body, time.perf_counter() - start, final=True)


def stream_http(
    url: str, params: GenerateParams | Sequence[GenerateParams], model: str = MODEL,
    timeout_s: float = 300.0
) -> Iterator[Chunk]:
    """POST /v2/models/<model>/generate_stream: server-sent events, one per response. Several
    `params` are one batched request, as `stream_grpc_batch` sends (each chunk's batch_index
    names its prompt); Triton's /generate takes one response only, so a batch streams. Triton's
    generate endpoints take no list input (stop words, bad words, allowed token ids,
    retention ranges) in a batched request: ValueError (`stream_grpc_batch` sends them).
    The events carry no final flag: the last chunk's `final` is set once the stream ended
    (as a list of the chunks shows it)."""
    start = time.perf_counter()
    if isinstance(params, GenerateParams):
        body = params.fields(True)
    else:  # a value per prompt
        lists = {name for p in params for name, value in p.fields(True).items()
                 if isinstance(value, list) or getattr(value, "size", 1) > 1}
        if lists:
            raise ValueError(f"a batched request over HTTP cannot set {sorted(lists)}: "
                             "Triton's generate endpoints take no list input in a batch; "
                             "send it over gRPC (stream_grpc_batch)")
        body = {name: [_json_row(row) for row in array]
                for name, array in batch_inputs(params, True).items()}
    last = None
    with _post(f"{url}/v2/models/{model}/generate_stream", body, timeout_s) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            body = json.loads(line[len("data:") :])
            if "error" in body:
                raise GenerateError("HTTP 200 (in stream)", body["error"])
            last = http_chunk(body, time.perf_counter() - start)
            yield last
    if last is not None:
        last.final = True


def http_chunk(body: dict[str, Any], elapsed_s: float, final: bool = False) -> Chunk:
    counts = {n: int(_first(body[n])) for n in COUNTS if n in body}
    texts = [str(t) for t in np.ravel(body.get("text_output", []))]
    perf = {n: _first(body[n]) for n in PERF_METRICS if n in body}
    chunk = make_chunk(texts, elapsed_s, counts, final, body.get("output_log_probs"),
                       body.get("cum_log_probs"), body.get("sequence_index"), perf,
                       body.get("finish_reason"))
    for name in ("generation_logits", "context_logits", "top_log_probs", "top_log_prob_ids",
                 *PROMPT_SCORES):
        if name in body:
            dtype = np.int32 if name.endswith(("ids", "ranks")) else np.float32
            setattr(chunk, name, np.asarray(body[name], dtype=dtype).reshape(-1))
    if "batch_index" in body:
        chunk.batch_index = int(_first(body["batch_index"]))
    return chunk


def _json_row(row: np.ndarray) -> Any:
    """One prompt's row of a batched input as JSON: its one value (list inputs are refused
    before)."""
    value = row.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def _post(url: str, fields: dict[str, Any], timeout_s: float) -> Any:
    data = json.dumps(fields).encode("utf-8")
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", errors="replace")
        text = body.strip()
        if text.startswith("data:"):  # generate_stream's error as a server-sent event
            text = text[len("data:"):].strip()
        try:
            message = json.loads(text).get("error", body)
        except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
            message = body
        raise GenerateError(f"HTTP {exc.code}", message) from None
