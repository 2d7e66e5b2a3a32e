"""Engine outputs -> hybrid_llm response tensors (TensorRT-LLM's `tensorrt_llm` outputs, ours,
and the three tensors that keep streamed detokenization exact in `postprocessing`).

A request asks for K = num_return_sequences sequences (default 1); each is one engine request,
and every tensor has a row per sequence, as TensorRT-LLM lays out beams. Every response
carries every output, because an ensemble only answers an iteration once all of its requested
outputs arrived for it:
  output_ids [1, K, T] INT32, sequence_length [1, K] INT32 (batch, sequence),
  num_input_tokens, num_output_tokens, cached_tokens, replayed_anchors, recomputed_tokens
  [1, 1] INT32, prefix_ids [1, K, P] INT32, prefix_length [1, K] INT32, flush [1, 1] BOOL,
  finish_reason [1, K] BYTES (ours: why each row's sequence ended, the engine's
  "eos" / "stop" / "length" / "cancelled", on the response that ends it; "" before),
  output_log_probs [1, K, N] FP32 and cum_log_probs [1, K] FP32 (TensorRT-LLM's; with
  return_log_probs: the model's log probability of each generated id in this response and
  their running sum; without it, N = 0 and the sums 0), sequence_index [1, 1] INT32 (as
  TensorRT-LLM's: the sequence a streamed response carries; -1 when it carries all),
  batch_index [1, 1] INT32 (as TensorRT-LLM's: which prompt of a batched request, input_ids
  [B, T], the response answers; 0 for a request of one prompt),
  and, only for a request that asks for them (an ensemble passes on the outputs a request's
  responses carry; every response of a request carries the same outputs), TensorRT-LLM's perf
  metrics (return_perf_metrics):
  kv_cache_alloc_new_blocks, kv_cache_reused_blocks, kv_cache_alloc_total_blocks,
  total_accepted_draft_tokens, total_draft_tokens [1, 1] INT32 (summed over the rows'
  sequences), arrival_time_ns, first_scheduled_time_ns, first_token_time_ns,
  last_token_time_ns [1, 1] INT64 (wall-clock ns: the earliest of the sequences', the latest
  for the last token; 0: not yet), acceptance_rate [1, 1] FP32 (accepted / verified drafts);
  top_log_probs [1, K, T, N] FP32 and top_log_prob_ids [1, K, T, N] INT32 (ours; with
  num_top_log_probs = N: the N likeliest tokens at the position of each generated id a row
  carries, likeliest first, and the model's log probability of each; rows padded with id -1
  and 0.0 to the longest), generation_logits [1, K, T, V] FP32 (return_generation_logits:
  the raw logits that chose each id a row carries, rows zero-padded to the longest) and
  context_logits [1, P, V] FP32 (return_context_logits: the prompt's logits, on the response
  that carries the first sequence's first ids, or the one non-streamed response; [1, 0, 0] on
  the others);
  return_prompt_log_probs (ours), on that same response: prompt_token_ids [1, P] INT32,
  prompt_log_probs [1, P - 1] FP32 (each prompt token's after the first),
  prompt_log_prob_ranks [1, P - 1] INT32 (its rank at its position, 1 = likeliest) and
  prompt_top_log_prob_ids [1, P - 1, N] INT32 / prompt_top_log_probs FP32 (its position's
  num_top_log_probs likeliest tokens; N = 0 without them); empty on the others.

Streaming: one response per engine output that brought tokens, for one sequence: its row holds
only those ids (never the prompt), the other rows none (length 0, no prefix), and
num_output_tokens their count, so a client summing it gets the total (as Triton's OpenAI
frontend does). The row's prefix_ids are the last PREFIX_LEN ids already streamed for that
sequence and flush is true on the sequence's last response (see backend/triton/README.md);
the cache counts are that sequence's. Non-streaming: one response once every sequence
finished, each row all of its generated ids (after the prompt unless
exclude_input_in_output); num_output_tokens and the cache counts are summed over the rows.
The final flag goes with the response that ends the last sequence.

Beam search (beam_width W > 1): one engine request, whose final output carries the finished
beams (`RequestOutput.beams`, best first); K = num_return_sequences (1..W) rows hold the best
K beams, each row a whole beam: its ids (not streaming: after the prompt unless
exclude_input_in_output), its own log probabilities and cum_log_prob, num_output_tokens
summed over the rows, the cache counts the one engine request's, sequence_index -1, prefix
empty. Not streaming, that is the request's one response. Streaming (as TensorRT-LLM streams
beams: every beam's tokens so far, since a step can reorder or replace beams), the engine
request streams its beams (`Request.stream_beams`) and every step's output becomes a
response laid out the same way, holding the best K running beams so far, never the prompt,
finish_reason "" and flush false (postprocessing decodes each row whole, holding back an
unfinished character); the final response holds the finished beams, flush true. A client
keeps the latest response's rows (they replace, not extend, the earlier ones). Rows beyond
the beams the search has (fewer than W only in corner cases) are empty.
"""

from __future__ import annotations

import numpy as np

from backend.detokenize import DEFAULT_CONTEXT_LEN
from backend.engine.request import BeamOutput, RequestMetrics, RequestOutput

PREFIX_LEN = DEFAULT_CONTEXT_LEN
Tensors = dict[str, np.ndarray]
COUNTS = ("cached_tokens", "replayed_anchors", "recomputed_tokens")
PERF_COUNTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
               "kv_cache_alloc_total_blocks", "total_accepted_draft_tokens", "total_draft_tokens")
PERF_FIRST_TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns")


class OutputStream:
    """Per-request state between the engine outputs of its K sequences and responses."""

    def __init__(self, request_key: str, prompt_ids: list[int], streaming: bool,
                 exclude_input: bool, num_sequences: int = 1, beam_search: bool = False,
                 extras: frozenset[str] = frozenset(), batch_index: int = 0) -> None:
        self.request_key = request_key
        self.batch_index = batch_index  # the request's prompt these responses answer
        self.prompt_ids = prompt_ids
        self.streaming = streaming
        self.exclude_input = exclude_input
        self.beam_search = beam_search  # one engine request; its final output has K rows
        # the optional outputs asked for: "perf_metrics", "generation_logits",
        # "context_logits", "top_log_probs", "prompt_log_probs"
        self.extras = extras
        # per sequence: ids streamed so far (streaming) or collected (otherwise), log
        # probabilities collected (not streaming), its latest output (counts, sums)
        self.generated: list[list[int]] = [[] for _ in range(num_sequences)]
        self.log_probs: list[list[float]] = [[] for _ in range(num_sequences)]
        self.tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(num_sequences)]
        self.last: list[RequestOutput | None] = [None] * num_sequences
        self.unfinished = 1 if beam_search else num_sequences
        # generation logits collected (not streaming), the prompt's logits until sent
        self.logits: list[list[np.ndarray]] = [[] for _ in range(num_sequences)]
        self.context: np.ndarray | None = None
        self.prompt_scores: tuple[list[float], list, list[int]] | None = None  # until sent

    @property
    def num_sequences(self) -> int:
        return len(self.generated)

    def on_output(self, out: RequestOutput, index: int = 0) -> tuple[Tensors | None, bool]:
        """(the tensors to send for sequence `index`'s output `out`, or None when nothing is
        due yet; whether this is the request's final response)."""
        if self.beam_search:
            return self._beams(out)
        self.last[index] = out
        self.unfinished -= out.finished
        final = self.unfinished == 0
        if out.context_logits is not None:
            self.context = _numpy(out.context_logits)
        if out.prompt_log_probs is not None:
            self.prompt_scores = _scores(out)
        logits = None if out.generation_logits is None else _numpy(out.generation_logits)
        if self.streaming:
            if not out.new_token_ids and not out.finished:
                return None, False
            prefix = self.generated[index][-PREFIX_LEN:]
            self.generated[index].extend(out.new_token_ids)
            rows = self._rows(index, out.new_token_ids)
            context, self.context = self.context, None
            scores, self.prompt_scores = self.prompt_scores, None
            reason = (out.finish_reason or "") if out.finished else ""
            return self._tensors(rows, self._rows(index, prefix), self._rows(index, out.log_probs),
                                 out.finished, [out], index, self._rows(index, reason, ""),
                                 logits=[logits if k == index else None
                                         for k in range(self.num_sequences)],
                                 context=context, tops=self._rows(index, out.top_log_probs),
                                 scores=scores), final
        self.generated[index].extend(out.new_token_ids)
        self.log_probs[index].extend(out.log_probs)
        self.tops[index].extend(out.top_log_probs)
        if logits is not None:
            self.logits[index].append(logits)
        if not final:
            return None, False
        ids = [g if self.exclude_input else self.prompt_ids + g for g in self.generated]
        logits = [np.concatenate(parts) if parts else None for parts in self.logits]
        reasons = [(o.finish_reason or "") if o is not None else "" for o in self.last]
        return self._tensors(ids, [[]] * self.num_sequences, self.log_probs, True, self.last, -1,
                             reasons, num_output=sum(len(g) for g in self.generated), logits=logits,
                             context=self.context, tops=self.tops, scores=self.prompt_scores), True

    def _beams(self, out: RequestOutput) -> tuple[Tensors | None, bool]:
        """A beam search's output: the best K beams, whole. Streaming, each output before the
        final one carries the best K running beams so far (flush false); otherwise nothing
        is sent before the final output. Streamed rows never hold the prompt."""
        if not out.finished and (not self.streaming or not out.beams):
            return None, False
        self.unfinished -= out.finished
        beams = out.beams
        if beams is None:  # not expected from the engine: the output as the one beam
            beams = [BeamOutput(list(out.new_token_ids), list(out.log_probs), out.cum_log_prob,
                                0.0, out.finish_reason or "")]
        beams = beams[:self.num_sequences]
        generated = [b.token_ids for b in beams] + [[]] * (self.num_sequences - len(beams))
        log_probs = [b.log_probs for b in beams] + [[]] * (self.num_sequences - len(beams))
        cum = [b.cum_log_prob for b in beams] + [0.0] * (self.num_sequences - len(beams))
        reasons = [b.finish_reason for b in beams] + [""] * (self.num_sequences - len(beams))
        bare = self.exclude_input or self.streaming
        ids = [g if bare else self.prompt_ids + g for g in generated]
        logits = [None if b.logits is None else _numpy(b.logits) for b in beams]
        logits += [None] * (self.num_sequences - len(beams))
        context = None if out.context_logits is None else _numpy(out.context_logits)
        scores = None if out.prompt_log_probs is None else _scores(out)
        return self._tensors(ids, [[]] * self.num_sequences, log_probs, out.finished, [out], -1,
                             reasons, num_output=sum(map(len, generated)), cum=cum,
                             logits=logits, context=context, scores=scores), out.finished

    def _rows(self, index: int, values, empty=None) -> list:
        """`values` in row `index`, `empty` (default: a new empty list) in the others."""
        return [values if k == index else ([] if empty is None else empty)
                for k in range(self.num_sequences)]

    def _tensors(self, ids: list[list[int]], prefix: list[list[int]],
                 log_probs: list[list[float]], flush: bool, outs: list, index: int,
                 reasons: list[str], num_output: int | None = None, cum: list[float] | None = None,
                 logits: list[np.ndarray | None] | None = None,
                 context: np.ndarray | None = None,
                 tops: list[list[list[tuple[int, float]]]] | None = None,
                 scores: tuple[list[float], list, list[int]] | None = None) -> Tensors:
        first = next(o for o in outs if o is not None)
        if cum is None:
            cum = [o.cum_log_prob if o is not None else 0.0 for o in self.last]
        tensors = {
            "output_ids": _padded(ids, np.int32),
            "sequence_length": np.array([[len(r) for r in ids]], dtype=np.int32),
            "num_input_tokens": _int32(first.num_input_tokens),
            "num_output_tokens": _int32(sum(map(len, ids)) if num_output is None
                                        else num_output),
            **{name: _int32(sum(getattr(o, name) for o in outs if o is not None))
               for name in COUNTS},
            "prefix_ids": _padded(prefix, np.int32),
            "prefix_length": np.array([[len(r) for r in prefix]], dtype=np.int32),
            "flush": np.array([[flush]], dtype=np.bool_),
            "request_key": np.array([[self.request_key.encode("utf-8")]], dtype=np.object_),
            "output_log_probs": _padded(log_probs, np.float32),
            "cum_log_probs": np.array([cum], dtype=np.float32),
            "sequence_index": _int32(index),
            "batch_index": _int32(self.batch_index),
            "finish_reason": np.array([[r.encode("utf-8") for r in reasons]], dtype=np.object_),
        }
        if "perf_metrics" in self.extras:
            tensors.update(_perf([o.metrics for o in outs
                                  if o is not None and o.metrics is not None]))
        if "generation_logits" in self.extras:
            tensors["generation_logits"] = _padded_logits(logits or [None] * len(ids))
        if "top_log_probs" in self.extras:
            tensors["top_log_prob_ids"], tensors["top_log_probs"] = _padded_tops(
                tops or [[]] * len(ids))
        if "prompt_log_probs" in self.extras:
            tensors.update(self._prompt_tensors(scores))
        if "context_logits" in self.extras:
            tensors["context_logits"] = (np.zeros((1, 0, 0), np.float32) if context is None
                                         else context[None].astype(np.float32, copy=False))
        return tensors


    def _prompt_tensors(self, scores: tuple[list[float], list, list[int]] | None) -> Tensors:
        """The prompt's ids and scores (return_prompt_log_probs), or empty ones."""
        values, tops, ranks = scores if scores is not None else ([], [], [])
        if tops:  # [1, 1, P - 1, N] -> [1, P - 1, N]
            top_ids, top_values = (a[0] for a in _padded_tops([tops]))
        else:  # no alternatives asked: [1, P - 1, 0]
            top_ids = np.zeros((1, len(values), 0), np.int32)
            top_values = np.zeros((1, len(values), 0), np.float32)
        prompt = self.prompt_ids if scores is not None else []
        return {"prompt_token_ids": np.array([prompt], dtype=np.int32).reshape(1, -1),
                "prompt_log_probs": np.array([values], dtype=np.float32).reshape(1, -1),
                "prompt_log_prob_ranks": np.array([ranks], dtype=np.int32).reshape(1, -1),
                "prompt_top_log_prob_ids": top_ids, "prompt_top_log_probs": top_values}


def _scores(out: RequestOutput) -> tuple[list[float], list, list[int]]:
    """An output's prompt scores: log probabilities, alternatives, ranks."""
    return (out.prompt_log_probs or [], out.prompt_top_log_probs or [],
            out.prompt_log_prob_ranks or [])


def _perf(metrics: list[RequestMetrics]) -> Tensors:
    """The perf-metrics tensors of the rows' sequences (zeros for none)."""
    out = {name: _int32(sum(getattr(m, name) for m in metrics)) for name in PERF_COUNTS}
    for name in PERF_FIRST_TIMES:
        times = [getattr(m, name) for m in metrics if getattr(m, name)]
        out[name] = np.array([[min(times, default=0)]], dtype=np.int64)
    out["last_token_time_ns"] = np.array(
        [[max((m.last_token_time_ns for m in metrics), default=0)]], dtype=np.int64)
    drafts = sum(m.total_draft_tokens for m in metrics)
    accepted = sum(m.total_accepted_draft_tokens for m in metrics)
    out["acceptance_rate"] = np.array([[accepted / drafts if drafts else 0.0]], dtype=np.float32)
    return out


def _numpy(logits) -> np.ndarray:
    """An engine logits tensor [n, V] (any device) as fp32 numpy."""
    return logits.detach().float().cpu().numpy()


def _padded_logits(rows: list[np.ndarray | None]) -> np.ndarray:
    """[1, K, T, V]: row k's logits [n_k, V] (None: none), zero-padded to the longest."""
    present = [r for r in rows if r is not None and len(r)]
    T = max((len(r) for r in present), default=0)
    V = present[0].shape[1] if present else 0
    out = np.zeros((1, len(rows), T, V), dtype=np.float32)
    for k, row in enumerate(rows):
        if row is not None and len(row):
            out[0, k, :len(row)] = row
    return out


def _padded_tops(rows: list[list[list[tuple[int, float]]]]) -> tuple[np.ndarray, np.ndarray]:
    """[1, K, T, N] ids (INT32, padding -1) and log probabilities (FP32, padding 0.0): row k's
    alternatives at each of its positions."""
    T = max(map(len, rows), default=0)
    N = max((len(position) for row in rows for position in row), default=0)
    ids = np.full((1, len(rows), T, N), -1, dtype=np.int32)
    values = np.zeros((1, len(rows), T, N), dtype=np.float32)
    for k, row in enumerate(rows):
        for t, position in enumerate(row):
            for n, (token, value) in enumerate(position):
                ids[0, k, t, n], values[0, k, t, n] = token, value
    return ids, values


def _padded(rows: list[list], dtype) -> np.ndarray:
    """[1, K, max row length], rows right-padded with zeros (lengths travel separately)."""
    out = np.zeros((1, len(rows), max(map(len, rows), default=0)), dtype=dtype)
    for k, row in enumerate(rows):
        out[0, k, :len(row)] = row
    return out


def _int32(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)
