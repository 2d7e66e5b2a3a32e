"""The decoupled `hybrid_llm` model: owns the engine thread and streams its outputs.

Life of a request: `execute` validates the tensors (`llm_request.parse_request`; a bad request
gets one INVALID_ARG response with the final flag; one past `max_queue_size` an UNAVAILABLE
one) and submits an engine `Request` whose
`on_output` callback, on the engine thread, turns each `RequestOutput` into tensors
(`llm_response.OutputStream`) and queues them for the responder thread. The engine ends every
request with a finished output (length, eos, stop, timed_out, cancelled or error), which sends
the final flag, so no client is left waiting. A watcher thread polls open requests for
cancellation and calls `engine.cancel`; a metrics thread refreshes the Prometheus families from
`engine.stats()`.

A batched request (input_ids [B, T], B prompts, as TensorRT-LLM's) is B engine requests under
one client stream: every prompt is validated before any is queued (an error names its row),
each prompt's responses carry its batch_index and are laid out as a request of that one prompt
(streamed as its tokens come, or one when it ends), the final flag goes with the last prompt's
last response, and a cancel, a `stop` or one prompt's failure ends them all. The queue's
max_queue_size counts a batch as one request.
"""

from __future__ import annotations

import gc
import itertools
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine, QueueFull
from backend.engine.request import Request, RequestOutput, SamplingParams
from backend.triton.errors import ConfigError, RequestError
from backend.triton.llm_config import ServingSettings, engine_params, serving_settings
from backend.triton.llm_request import (
    LlmRequest,
    cache_reset_of,
    is_stop,
    lora_update_of,
    parse_batch,
)
from backend.triton.llm_response import OutputStream
from backend.triton.metrics import EngineMetrics
from backend.triton.params import parse_model_config
from backend.triton.responder import GuardedSender, Outgoing, Responder, log
from backend.triton.responses import request_inputs


@dataclass
class OpenRequest:
    """A request the engine holds (one entry per sequence, all sharing the client's sender
    and stream); an entry is removed when its sequence's final output arrives.

    Sequence 0 is submitted at once, its siblings (num_return_sequences > 1) when its first
    output arrives: by then its prompt's pages and the state at their end are in the prefix
    store, so the siblings start from the cache instead of prefilling the prompt again. A beam
    search is one engine request (no siblings) whose final output carries every beam (streamed,
each step's output carries the running beams so far)."""

    sender: Any
    stream: OutputStream
    cancelled: bool = False
    stopped: bool = False  # by a `stop` request: its client still listens
    index: int = 0
    siblings: list = field(default_factory=list)  # (entry, engine Request) still to submit
    group: GroupState | None = None


@dataclass
class GroupState:
    """What the sequences of one request share: whether it was cancelled or failed (the
    siblings not yet submitted are then dropped) and whether its final response went."""

    cancelled: bool = False
    closed: bool = False
    items: int = 1  # the request's prompts (a batched request's B) still to end
    lock: threading.Lock = field(default_factory=threading.Lock)


class HybridLlm:
    def __init__(self, pb_utils: ModuleType, args: Mapping[str, str]) -> None:
        self.pb_utils = pb_utils
        config = parse_model_config(args)
        self.settings = serving_settings(config, Path(args["model_repository"]))
        self.engine = build_engine(self.settings, engine_params(config))
        self.responder = Responder(pb_utils)
        self.open: dict[str, OpenRequest] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.stopping = threading.Event()
        self.num_recomputed_tokens = 0  # summed over finished requests (written by the engine)
        self.metrics = EngineMetrics(
            pb_utils, args.get("model_name", "hybrid_llm"), args.get("model_version", "1")
        )
        self.engine.start()
        if self.settings.guided_decoding_backend == "xgrammar":
            threading.Thread(target=self._load_grammars, name="hybrid_llm-grammars",
                             daemon=True).start()
        self.threads = [
            self._loop("cancel-watcher", self.settings.cancellation_check_period_ms, self._poll),
            self._loop("metrics", self.settings.stats_check_period_ms, self._refresh_metrics),
        ]
        self._refresh_metrics()

    # Triton entry points ------------------------------------------------------------------
    def execute(self, requests: Sequence[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except RequestError as exc:
                self.responder.send_now(
                    Outgoing(sender, error=str(exc), error_code="INVALID_ARG", final=True)
                )
            except QueueFull as exc:  # max_queue_size: not this request's fault; retry
                self.responder.send_now(
                    Outgoing(sender, error=str(exc), error_code="UNAVAILABLE", final=True)
                )
            except Exception as exc:  # a bug fails this request, not the model
                log(self.pb_utils, f"hybrid_llm: request failed: {exc!r}", "error")
                self.responder.send_now(
                    Outgoing(sender, error=f"internal error: {exc!r}", final=True)
                )

    def finalize(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=5)
        self.engine.stop()
        with self.lock:
            leftover, self.open = self.open, {}
        for entry in leftover.values():  # one final response per request still open
            with entry.group.lock:
                close, entry.group.closed = not entry.group.closed, True
            if close:
                self.responder.put(Outgoing(entry.sender, error="the model was unloaded",
                                            final=True))
        self.responder.close()
        self.metrics.close()
        # Response senders left in reference cycles (a request's entry and its engine
        # request's callback) are freed now, while the stub can still tear them down: freed
        # by the interpreter's last collection, after the backend is gone, a sender that was
        # asked is_cancelled() crashed the stub (SIGSEGV in ~ResponseSender).
        gc.collect()

    # Requests -----------------------------------------------------------------------------
    def _submit(self, request: Any, sender: Any) -> None:
        inputs = request_inputs(request)
        if is_stop(inputs):
            if not request.request_id():  # as TensorRT-LLM: a stop names what it stops
                raise RequestError("a request id must be provided to stop a request "
                                   "(stop = true)")
            self._stop(request.request_id())
            self.responder.send_now(Outgoing(sender, final=True))
            return
        if (update := lora_update_of(inputs)) is not None:
            self._update_lora(*update, sender)
            return
        if (reset := cache_reset_of(inputs)) is not None:
            try:
                result = self.engine.reset_prefix_cache(*reset)
            except ValueError as exc:  # a cache_salt no request could have
                raise RequestError(str(exc)) from None
            log(self.pb_utils, f"hybrid_llm: prefix cache reset: {result}")
            tensors = {name: np.array([[value]], dtype=np.int64)
                       for name, value in result.items()}
            self.responder.send_now(Outgoing(sender, tensors, final=True))
            return
        items = parse_batch(
            inputs,
            self.engine.tokenizer.eos_token_id,
            self.settings.exclude_input_in_output,
        )
        if self.settings.guided_decoding_backend == "none" and \
                any(parsed.sampling.guide is not None for parsed in items):
            raise RequestError("guided decoding is off on this model (parameter "
                               "guided_decoding_backend is none)")
        # A request without a Triton id gets one no client can name in a `stop` (a stop for
        # "req" used to end every such request); postprocessing stops it by this exact id.
        request_id = f"{request.request_id()}#{next(self.ids)}" if request.request_id() \
            else f"#{next(self.ids)}.{secrets.token_hex(4)}"
        # The watcher polls it: never is_cancelled() after its final response.
        sender = GuardedSender(sender, self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        group = GroupState(items=len(items))
        arrival = time.monotonic()  # allotted_time_ms counts from here
        firsts = []
        for row, parsed in enumerate(items):
            # Prompt b > 0 of a batch runs as "<id>/b<b>"; every prompt's responses carry the
            # request's id as their key, so a `stop` for it ends them all.
            item_id = request_id if row == 0 else f"{request_id}/b{row}"
            deadline = None if parsed.allotted_time_ms is None else \
                arrival + parsed.allotted_time_ms / 1000
            first = self._entries(parsed, item_id, sender, group, deadline,
                                  stream_for(request_id, parsed, row))
            firsts.append(first)
        for row, (_, engine_request) in enumerate(firsts if len(items) > 1 else ()):
            try:  # a batch is refused whole, before any prompt runs (submit checks one)
                self.engine.validate(engine_request)  # context, vocabulary, beams, adapter
                if (guide := engine_request.sampling.guide) is not None:
                    self.engine.grammars().compile(guide)  # (cached for its submit)
            except ValueError as exc:
                raise RequestError(f"batch item {row}: {exc}") from None
        with self.lock:
            self.open.update((r.request_id, entry) for entry, r in firsts)
        for row, (entry, engine_request) in enumerate(firsts):
            try:  # the queue's limit counts a batch once (its first prompt)
                self.engine.submit(engine_request, over_queue_limit=row > 0)
            except BaseException as exc:
                self._abandon(firsts, row, sender, exc)
                if row == 0:
                    if isinstance(exc, ValueError):
                        raise RequestError(str(exc)) from None
                    raise
                return
            if entry.cancelled:  # the client cancelled before it was queued
                self.engine.cancel(engine_request.request_id)

    def _entries(self, parsed: LlmRequest, request_id: str, sender: Any, group: GroupState,
                 deadline: float | None, stream: OutputStream) -> tuple[OpenRequest, Request]:
        """One prompt's sequence 0 (its entry and engine request), its siblings attached."""
        entries = []
        for k in range(parsed.num_engine_requests):  # a beam search: one, for all its beams
            entry = OpenRequest(sender, stream, index=k, group=group)
            entries.append((entry, Request(
                request_id=request_id if k == 0 else f"{request_id}/{k}",
                prompt_ids=parsed.prompt_ids,
                sampling=sibling_sampling(parsed.sampling, k),
                cache_salt=parsed.cache_salt,
                session_id=parsed.session_id,
                priority=parsed.priority,
                lora_name=parsed.lora_name,
                on_output=lambda out, entry=entry: self._on_output(entry, out),
                return_perf_metrics=parsed.return_perf_metrics,
                return_generation_logits=parsed.return_generation_logits,
                # one prompt: its logits once, from the first sequence (which computes it)
                return_context_logits=parsed.return_context_logits and k == 0,
                return_prompt_log_probs=parsed.return_prompt_log_probs and k == 0,
                retention=parsed.retention,
                stream_beams=parsed.streaming and parsed.beam_search,
                prediction=parsed.prediction,
                deadline=deadline,
            )))
        (first, engine_request), first.siblings = entries[0], entries[1:]
        return first, engine_request

    def _abandon(self, firsts: list[tuple[OpenRequest, Request]], failed: int, sender: Any,
                 exc: BaseException) -> None:
        """Prompt `failed` of a request could not be queued: the prompts before it (and any
        sibling sequence of theirs already running) are cancelled and none of their responses
        is sent after this. The first prompt's failure is the caller's to answer (nothing
        ran); a later one's error goes out here, in order after the responses the earlier
        prompts already sent."""
        group = firsts[0][0].group
        with group.lock:
            close, group.closed = not group.closed, True
            group.cancelled = True  # no sibling is submitted after this
        with self.lock:
            for _, r in firsts[failed:]:  # never queued
                self.open.pop(r.request_id, None)
            running = [rid for rid, e in self.open.items() if e.group is group]
            for rid in running:
                self.open[rid].cancelled = True
        for rid in running:
            self.engine.cancel(rid)
        if failed and close:
            invalid = isinstance(exc, ValueError)
            log(self.pb_utils, f"hybrid_llm: batch item {failed} not queued: {exc!r}",
                "warn" if invalid else "error")
            self.responder.put(Outgoing(
                sender, error=f"batch item {failed}: {exc}" if invalid
                else f"internal error: batch item {failed}: {exc!r}",
                error_code="INVALID_ARG" if invalid else "INTERNAL", final=True))

    def _update_lora(self, action: str, name: str, path: str | None, sender: Any) -> None:
        """A runtime LoRA load or unload (`allow_runtime_lora`); refusals are INVALID_ARG."""
        if not self.settings.allow_runtime_lora:
            raise RequestError("runtime LoRA updates are off on this model (parameter "
                               "allow_runtime_lora is false)")
        try:
            if action == "load":
                self.engine.load_lora(name, path)
                tensors = None
            else:
                result = self.engine.unload_lora(name)
                tensors = {"dropped_pages": np.array([[result["dropped_pages"]]], np.int64)}
        except ValueError as exc:  # a bad name / folder / adapter, or one still in use
            raise RequestError(str(exc)) from None
        log(self.pb_utils, f"hybrid_llm: LoRA adapter {name!r} {action}ed")
        self.responder.send_now(Outgoing(sender, tensors, final=True))

    def _submit_siblings(self, entry: OpenRequest) -> None:
        """Engine thread, sequence 0's first output: the other sequences go to the engine
        (unless the request was cancelled or failed meanwhile)."""
        siblings, entry.siblings = entry.siblings, []
        for sibling, request in siblings:
            with self.lock:
                if entry.group.cancelled or entry.cancelled:
                    return
                self.open[request.request_id] = sibling
            try:
                # the prompt passed sequence 0's checks, and the request the queue's limit
                self.engine.submit(request, over_queue_limit=True)
            except Exception as exc:  # e.g. the engine is stopping: the request fails whole
                with self.lock:
                    self.open.pop(request.request_id, None)
                log(self.pb_utils, f"hybrid_llm: {request.request_id} not submitted: {exc!r}",
                    "error")
                self._on_output(sibling, RequestOutput(request.request_id, [], True, "error",
                                                       error=f"internal error: {exc!r}"))
                return
            if sibling.cancelled:  # cancelled while it was being submitted
                self.engine.cancel(request.request_id)

    def _on_output(self, entry: OpenRequest, out: RequestOutput) -> None:
        # Engine thread: build tensors, enqueue, return.
        group = entry.group
        if out.finished:
            with self.lock:
                self.open.pop(out.request_id, None)
            self.num_recomputed_tokens += out.recomputed_tokens
        failed = out.error is not None or out.finish_reason == "error"
        cancelled = out.finish_reason == "cancelled" or entry.cancelled
        if entry.stopped and not failed:
            # A `stop` from another request: the client still listens. Each sequence ends
            # with what it generated (finish_reason "cancelled", or its own if it finished
            # first), the final flag with the request's last one, as a request that ends on
            # its own; sequences not submitted yet end at once, with nothing generated.
            self._end_unsubmitted(entry)
        elif failed or cancelled:
            with group.lock:  # the whole request ends with its first failed / cancelled part
                group.cancelled = True
                close = not group.closed and (failed or out.finished)
                group.closed |= close
            self._cancel_others(entry)
            if close and failed:
                message = out.error or "the engine failed this request"
                self.responder.put(Outgoing(entry.sender, error=message, final=True))
            elif close:  # the client is gone: close the stream
                self.responder.put(Outgoing(entry.sender, final=True))
            return
        if entry.siblings:
            self._submit_siblings(entry)
        with group.lock:
            if group.closed:
                return
            tensors, final = entry.stream.on_output(out, entry.index)
            if final:  # this prompt's last response: the request's once every prompt ended
                group.items -= 1
                final = group.items == 0
            group.closed = final
            if tensors is not None:  # the final flag as a tensor too (BLS callers)
                tensors = {**tensors, "response_final": np.array([[final]], dtype=np.bool_)}
            if tensors is not None or final:
                self.responder.put(Outgoing(entry.sender, tensors, final=final))

    def _end_unsubmitted(self, entry: OpenRequest) -> None:
        """A stopped request's sequences that were never submitted (`num_return_sequences`
        siblings waiting for the first one's first token) end, stopped too, with no tokens."""
        siblings, entry.siblings = entry.siblings, []
        if not siblings:
            return
        with entry.group.lock:
            entry.group.cancelled = True  # (nothing submits them later)
        for sibling, request in siblings:
            sibling.cancelled = sibling.stopped = True
            self._on_output(sibling, RequestOutput(request.request_id, [], True, "cancelled"))

    def _cancel_others(self, entry: OpenRequest) -> None:
        """The other running sequences of `entry`'s request are cancelled (their outputs are
        then dropped: the request already ended)."""
        entry.siblings = []
        with self.lock:
            others = [(rid, e) for rid, e in self.open.items()
                      if e.group is entry.group and e is not entry]
            for _, other in others:
                other.cancelled = True
        for rid, _ in others:
            self.engine.cancel(rid)

    def _stop(self, key: str) -> None:
        """`stop` = true: cancel the open request `key` (an engine id, or a Triton id)."""
        with self.lock:
            # a Triton id's requests ("key#n"), or an engine id and its sequences ("key/k")
            matches = [rid for rid in self.open
                       if rid == key or rid.startswith((f"{key}#", f"{key}/"))]
            for rid in matches:
                self.open[rid].cancelled = self.open[rid].stopped = True
        for rid in matches:
            self.engine.cancel(rid)
            log(self.pb_utils, f"hybrid_llm: {rid} stopped (stop=true)")

    def _poll(self) -> None:
        with self.lock:
            entries = [(rid, e) for rid, e in self.open.items() if not e.cancelled]
        for request_id, entry in entries:
            try:
                cancelled = entry.sender.is_cancelled()
            except Exception as exc:  # the stream closed between the snapshot and now
                log(self.pb_utils, f"hybrid_llm: is_cancelled failed: {exc!r}", "verbose")
                continue
            if cancelled:
                entry.cancelled = True
                self.engine.cancel(request_id)
                log(self.pb_utils, f"hybrid_llm: {request_id} cancelled by its client")

    def _load_grammars(self) -> None:
        """Imports XGrammar and builds the vocabulary's grammar compiler off the request
        path (seconds: it imports transformers), so the first guided request finds it."""
        try:
            self.engine.grammars()
        except Exception as exc:  # guided requests will say why they fail
            log(self.pb_utils, f"hybrid_llm: guided decoding unavailable: {exc}", "warn")

    def _refresh_metrics(self) -> None:
        stats = self.engine.stats()
        # Until the engine counts it itself: prompt tokens prefilled by finished requests.
        stats.setdefault("recomputed_tokens", self.num_recomputed_tokens)
        self.metrics.update(stats)

    def _loop(self, name: str, period_ms: int, step: Any) -> threading.Thread:
        def run() -> None:
            while not self.stopping.wait(period_ms / 1000):
                try:
                    step()
                except Exception as exc:  # keep polling; a failing step is logged each time
                    log(self.pb_utils, f"hybrid_llm {name}: {exc!r}", "error")

        thread = threading.Thread(target=run, name=f"hybrid_llm-{name}", daemon=True)
        thread.start()
        return thread


def stream_for(request_id: str, parsed: LlmRequest, batch_index: int = 0) -> OutputStream:
    return OutputStream(request_id, parsed.prompt_ids, parsed.streaming,
                        parsed.exclude_input_in_output, parsed.num_return_sequences,
                        beam_search=parsed.beam_search, extras=parsed.extras,
                        batch_index=batch_index)


def sibling_sampling(sampling: SamplingParams, k: int) -> SamplingParams:
    """Sequence k's sampling: a seeded request's sequences draw from seeds seed, seed + 1, ...
    (the same seed would repeat sequence 0); unseeded ones from the global generator."""
    if k == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + k) % (1 << 64))


def build_engine(settings: ServingSettings, params: dict[str, str]) -> Engine:
    """The started-to-be engine; a bad parameter raises `ConfigError` naming it."""
    try:
        config = EngineConfig.from_params(params)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        return Engine.from_model_dir(settings.model_path, config, settings.calibration_path)
    except (FileNotFoundError, ValueError) as exc:
        # (the model, the engine folder, the SSD path, an adapter...: the message names it)
        raise ConfigError(f"cannot start the engine on model_path="
                          f"{str(settings.model_path)!r}: {exc}") from exc
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and "alloc" not in str(exc):
            raise
        sizes = {k: params[k] for k in POOL_PARAMETERS if params.get(k, "").strip()}
        raise ConfigError(f"the engine's pools do not fit in memory ({exc!s:.200}); make "
                          f"them smaller: {sizes or 'the defaults'}") from exc


# What a pool's size comes from (named when they do not fit in memory).
POOL_PARAMETERS = ("num_kv_pages", "num_anchor_blocks", "num_checkpoint_slots", "max_num_seqs",
                   "max_tokens_per_step", "host_pages", "host_checkpoint_slots")
