"""The `hybrid_llm_bls` model: the ensemble's pipeline in one decoupled Python model (as
TensorRT-LLM's `tensorrt_llm_bls` beside its `ensemble`), with the same inputs and outputs.

It follows the ensemble's own `ensemble_scheduling` (read from the repository's `ensemble`
config.pbtxt, parameter `ensemble_config`, so the two cannot drift): the `preprocessing`
step's work (`tokenize.Preprocessor`) and the `postprocessing` step's (`postprocess
.Postprocessor`) run in this process, the `hybrid_llm` step is the one request this model
makes to Triton (a decoupled BLS request, on a thread of its own per request), and each of
its responses becomes one response here, its tensors named by the steps' input and output
maps exactly as the ensemble names them.

Why a second way in: the ensemble makes a new Triton request to postprocessing for every
streamed response. Once tritonserver is told to stop (SIGTERM / SIGINT) it refuses new
requests, those included, and the ensemble's in-flight streams stall (Triton 2.51: the client
gets no error, it waits), so a rolling restart cuts every running generation. Here nothing
new is asked of Triton after the start, and Triton waits for the open streams (up to its
`--exit-timeout-secs`) before unloading. The price is throughput under concurrency: the
ensemble spreads tokenizing and detokenizing over two more processes, this model does both
in its own, its request threads calling pb_utils one at a time (`pb_lock`: the stub crashed
with heap corruption when 8 threads called it at once). `client/bench/bls.py` (2 cores):
1.11x the ensemble's tokens/s for one stream, 0.67x for 8 at once.

A client that cancels is seen by a watcher thread (every `cancellation_check_period_ms`):
hybrid_llm gets `stop` for the inner request (`cancel.stop_generation`), which ends it.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from backend.triton.cancel import stop_generation
from backend.triton.errors import ConfigError, RequestError
from backend.triton.params import (
    get_bool_param,
    get_param,
    load_tokenizer_param,
    parse_model_config,
    repository_root,
)
from backend.triton.postprocess import Postprocessor
from backend.triton.responder import GuardedSender, Outgoing, log, send
from backend.triton.responses import request_inputs
from backend.triton.tokenize import Preprocessor

# hybrid_llm's output that marks its final response (BLS callers cannot read Triton's flag)
FINAL = "response_final"
ERROR_CODES = ("INVALID_ARG", "UNAVAILABLE", "NOT_FOUND", "UNSUPPORTED", "ALREADY_EXISTS",
               "CANCELLED", "INTERNAL", "UNKNOWN")


@dataclass(frozen=True)
class Step:
    """One step of an ensemble: its model and the names its tensors have outside it."""

    model: str
    inputs: dict[str, str]  # the model's input name -> the ensemble's tensor name
    outputs: dict[str, str]  # the model's output name -> the ensemble's tensor name


def read_config(path: Path) -> dict[str, Any]:
    """A config.pbtxt as the dict Triton gives Python models (`json_format`, field names as
    in the file)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    try:
        message = text_format.Parse(path.read_text(encoding="utf-8"),
                                    model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def ensemble_steps(config: Mapping[str, Any]) -> list[Step]:
    """The steps of an ensemble config (`read_config`); ConfigError unless they are the
    preprocessing -> LLM -> postprocessing pipeline this model runs."""
    steps = [Step(s["model_name"], dict(s.get("input_map", {})), dict(s.get("output_map", {})))
             for s in config.get("ensemble_scheduling", {}).get("step", [])]
    names = [s.model for s in steps]
    if len(steps) != 3 or names[0] != "preprocessing" or names[2] != "postprocessing":
        raise ConfigError(f"ensemble {config.get('name')!r}: steps {names}; this model runs "
                          "preprocessing -> the LLM -> postprocessing")
    return steps


@dataclass
class OpenStream:
    sender: GuardedSender
    inner_id: str
    stopped: bool = False
    submitted: bool = False  # its hybrid_llm request exists: a stop can reach it


class HybridLlmBls:
    def __init__(self, pb_utils: ModuleType, args: Mapping[str, str]) -> None:
        self.pb_utils = pb_utils
        config = parse_model_config(args)
        root = repository_root(args)
        ensemble = get_param(config, "ensemble_config", "ensemble")
        self.pre, self.llm, self.post = ensemble_steps(
            read_config(root / ensemble / "config.pbtxt"))
        self.outputs = [o["name"] for o in config.get("output", [])]
        tokenizer = load_tokenizer_param(config, args)
        self.preprocess = Preprocessor(tokenizer, get_bool_param(config, "add_special_tokens",
                                                                 True))
        self.postprocess = Postprocessor(tokenizer, get_bool_param(config,
                                                                   "skip_special_tokens", True))
        period = get_param(config, "cancellation_check_period_ms", "100")
        try:
            self.check_s = int(period) / 1000
        except ValueError:
            self.check_s = 0.0
        if self.check_s <= 0:  # (0 or less: the cancel watcher would spin on the cores)
            raise ConfigError("parameter cancellation_check_period_ms must be an integer > 0, "
                              f"got {period!r}")
        self.open: dict[int, OpenStream] = {}
        self.lock = threading.Lock()
        # Every call into pb_utils from this model's threads holds it (the stub crashed,
        # malloc heap corruption, with 8 request threads calling it at once); waiting for
        # hybrid_llm's next response does not.
        self.pb_lock = threading.RLock()
        self.ids = itertools.count()
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="bls-cancel-watcher",
                                        daemon=True)
        self.watcher.start()

    # Triton entry points ------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        pb = self.pb_utils
        for request in requests:
            with self.pb_lock:
                sender = GuardedSender(request.get_response_sender(),
                                       pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                try:
                    tensors = {k: np.array(v) for k, v in request_inputs(request).items()}
                    requested = set(request.requested_output_names() or [])
                    base = request.request_id() or "bls"
                except Exception as exc:  # noqa: BLE001 - this request fails, not the model
                    send(pb, Outgoing(sender, error=f"internal error: {exc!r}", final=True))
                    continue
            stream = OpenStream(sender, f"{base}.{uuid.uuid4().hex[:12]}")
            threading.Thread(target=self._run, args=(stream, tensors, requested),
                             name="bls-request", daemon=True).start()

    def finalize(self) -> None:
        self.stopping.set()
        self.watcher.join(timeout=5)

    # One request ------------------------------------------------------------------------
    def _run(self, stream: OpenStream, tensors: dict[str, np.ndarray],
             requested: set[str]) -> None:
        key = next(self.ids)
        with self.lock:
            self.open[key] = stream
        try:
            self._pipeline(stream, tensors, requested)
        except RequestError as exc:
            self._send(Outgoing(stream.sender, error=str(exc), error_code="INVALID_ARG",
                                final=True))
        except Exception as exc:  # noqa: BLE001 - this request fails, not the model
            with self.pb_lock:
                log(self.pb_utils, f"hybrid_llm_bls: request failed: {exc!r}", "error")
            self._send(Outgoing(stream.sender, error=f"internal error: {exc!r}", final=True))
        finally:
            with self.lock:
                self.open.pop(key, None)

    def _pipeline(self, stream: OpenStream, tensors: dict[str, np.ndarray],
                  requested: set[str]) -> None:
        pb = self.pb_utils
        tensors = dict(tensors)
        _run_step(self.pre, self.preprocess, tensors)
        with self.pb_lock:
            # A cancel before the hybrid_llm request exists has nothing to stop (the watcher
            # leaves streams not submitted alone): it ends here, or the watcher stops the
            # request once it is submitted (it ran to max_tokens for a client long gone).
            if stream.sender.is_cancelled():
                log(pb, f"hybrid_llm_bls: {stream.inner_id} cancelled before its generation "
                        "started")
                send(pb, Outgoing(stream.sender, error="the request was cancelled before its "
                                  "generation started", error_code="CANCELLED", final=True))
                return
            inputs = [pb.Tensor(name, tensors[source])
                      for name, source in self.llm.inputs.items() if source in tensors]
            inner = pb.InferenceRequest(model_name=self.llm.model, inputs=inputs,
                                        requested_output_names=[*self.llm.outputs, FINAL],
                                        request_id=stream.inner_id)
            responses = inner.exec(decoupled=True)
            stream.submitted = True
            del inputs, inner
        final_sent = False
        for response in responses:  # waiting for the next one: without the lock
            with self.pb_lock:
                got, error, final = self._read(response, step := dict(tensors))
                del response  # freed under the lock
            if error is not None:
                self._send(Outgoing(stream.sender, error=error[0], error_code=error[1],
                                    final=True))
                return
            if not got:  # the stream's closing response (only the final flag)
                continue
            _run_step(self.post, self.postprocess, step)
            out = {name: step[name] for name in self.outputs
                   if name in step and (not requested or name in requested)}
            self._send(Outgoing(stream.sender, out, final=final and not final_sent))
            final_sent = final_sent or final
        with self.pb_lock:
            del responses
        if not final_sent:
            self._send(Outgoing(stream.sender, final=True))

    def _read(self, response: Any, step: dict[str, np.ndarray],
              ) -> tuple[bool, tuple[str, str] | None, bool]:
        """hybrid_llm's response into `step` (copies, by the step's output map): whether it
        held outputs, its error (message, code name), whether it is the final one."""
        pb = self.pb_utils
        if response.has_error():
            error = response.error()
            return False, (error.message(), self._code_name(error)), True
        got = False
        for name, target in self.llm.outputs.items():
            tensor = pb.get_output_tensor_by_name(response, name)
            if tensor is not None:
                step[target] = np.array(tensor.as_numpy())
                got = True
        final = pb.get_output_tensor_by_name(response, FINAL)
        return got, None, final is not None and bool(final.as_numpy().any())

    def _send(self, item: Outgoing) -> None:
        with self.pb_lock:
            send(self.pb_utils, item)

    def _code_name(self, error: Any) -> str:
        code = error.code() if hasattr(error, "code") else None
        for name in ERROR_CODES:
            if code is not None and getattr(self.pb_utils.TritonError, name, None) == code:
                return name
        return "INTERNAL"

    # Cancellation -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.stopping.wait(self.check_s):
            with self.lock:
                streams = [s for s in self.open.values() if s.submitted and not s.stopped]
            for stream in streams:
                try:
                    with self.pb_lock:
                        cancelled = stream.sender.is_cancelled()
                except Exception:  # noqa: BLE001 - the stream closed meanwhile
                    continue
                if cancelled:
                    stream.stopped = True
                    try:
                        with self.pb_lock:  # (the stop request's answer comes at once)
                            stop_generation(self.pb_utils, stream.inner_id, self.llm.model)
                    except Exception as exc:  # noqa: BLE001 - e.g. the server is stopping
                        log(self.pb_utils, f"hybrid_llm_bls: stopping {stream.inner_id} "
                                           f"failed: {exc!r}", "warn")


def _run_step(step: Step, work, tensors: dict[str, np.ndarray]) -> None:
    """An in-process step: its inputs from `tensors` by the step's map, its outputs back."""
    outputs = work({name: tensors[source] for name, source in step.inputs.items()
                    if source in tensors})
    for name, target in step.outputs.items():
        if name in outputs:
            tensors[target] = outputs[name]
