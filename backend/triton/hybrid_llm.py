"""The decoupled `hybrid_llm` model: owns the engine thread and streams its outputs.

Life of a request: `execute` validates the tensors (`llm_request.parse_request`; a bad request
gets one INVALID_ARG response with the final flag) and submits an engine `Request` whose
`on_output` callback, on the engine thread, turns each `RequestOutput` into tensors
(`llm_response.OutputStream`) and queues them for the responder thread. The engine ends every
request with a finished output (length, eos, stop, cancelled or error), which sends the final
flag, so no client is left waiting. A watcher thread polls open requests for cancellation and
calls `engine.cancel`; a metrics thread refreshes the Prometheus families from `engine.stats()`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.engine.request import Request, RequestOutput
from backend.triton.errors import ConfigError, RequestError
from backend.triton.llm_config import ServingSettings, engine_params, serving_settings
from backend.triton.llm_request import LlmRequest, is_stop, parse_request
from backend.triton.llm_response import OutputStream
from backend.triton.metrics import EngineMetrics
from backend.triton.params import parse_model_config
from backend.triton.responder import GuardedSender, Outgoing, Responder, log
from backend.triton.responses import request_inputs


@dataclass
class OpenRequest:
    """A request the engine holds; removed when its final output arrives."""

    sender: Any
    stream: OutputStream
    cancelled: bool = False


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
        for entry in leftover.values():
            self.responder.put(Outgoing(entry.sender, error="the model was unloaded", final=True))
        self.responder.close()
        self.metrics.close()

    # Requests -----------------------------------------------------------------------------
    def _submit(self, request: Any, sender: Any) -> None:
        inputs = request_inputs(request)
        if is_stop(inputs):
            self._stop(request.request_id())
            self.responder.send_now(Outgoing(sender, final=True))
            return
        parsed = parse_request(
            inputs,
            self.engine.tokenizer.eos_token_id,
            self.settings.exclude_input_in_output,
        )
        request_id = f"{request.request_id() or 'req'}#{next(self.ids)}"
        # The watcher polls it: never is_cancelled() after its final response.
        sender = GuardedSender(sender, self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        entry = OpenRequest(sender, stream_for(request_id, parsed))
        engine_request = Request(
            request_id=request_id,
            prompt_ids=parsed.prompt_ids,
            sampling=parsed.sampling,
            cache_salt=parsed.cache_salt,
            session_id=parsed.session_id,
            on_output=lambda out: self._on_output(entry, out),
        )
        with self.lock:
            self.open[request_id] = entry
        try:
            self.engine.submit(engine_request)
        except BaseException as exc:
            with self.lock:
                self.open.pop(request_id, None)
            if isinstance(exc, ValueError):  # the engine's checks: context length, vocabulary
                raise RequestError(str(exc)) from None
            raise

    def _on_output(self, entry: OpenRequest, out: RequestOutput) -> None:
        # Engine thread: build tensors, enqueue, return.
        if out.finished:
            with self.lock:
                self.open.pop(out.request_id, None)
            self.num_recomputed_tokens += out.recomputed_tokens
        if out.error is not None or out.finish_reason == "error":
            message = out.error or "the engine failed this request"
            self.responder.put(Outgoing(entry.sender, error=message, final=True))
        elif out.finish_reason == "cancelled" or entry.cancelled:
            if out.finished:  # the client is gone: only close the stream
                self.responder.put(Outgoing(entry.sender, final=True))
        else:
            tensors = entry.stream.on_output(out)
            if tensors is not None or out.finished:
                self.responder.put(Outgoing(entry.sender, tensors, final=out.finished))

    def _stop(self, key: str) -> None:
        """`stop` = true: cancel the open request `key` (an engine id, or a Triton id)."""
        with self.lock:
            matches = [rid for rid in self.open if rid == key or rid.startswith(f"{key}#")]
            for rid in matches:
                self.open[rid].cancelled = True
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


def stream_for(request_id: str, parsed: LlmRequest) -> OutputStream:
    return OutputStream(
        request_id, parsed.prompt_ids, parsed.streaming, parsed.exclude_input_in_output
    )


def build_engine(settings: ServingSettings, params: dict[str, str]) -> Engine:
    """The started-to-be engine; a bad parameter raises `ConfigError` naming it."""
    try:
        config = EngineConfig.from_params(params)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        return Engine.from_model_dir(settings.model_path, config)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"parameter model_path={str(settings.model_path)!r}: {exc}") from exc
