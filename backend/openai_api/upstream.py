"""The Triton side of the OpenAI frontend: one gRPC channel to the server, one bidirectional
`ModelStreamInfer` stream a request (the ensemble is decoupled: every response of a request
comes on it, the last flagged final), and the served configuration the frontend needs.

`ServedModel.load` reads, from the running server: the ensemble's input dtypes (inputs are
built with them), the preprocessing model's `tokenizer_dir` and hybrid_llm's `model_path` and
`max_context_len` (resolved against `model_repository`, the folder the server was started with),
so the frontend counts prompt tokens and renders chat templates with the tokenizer the server
uses. Cancelling a stream (the HTTP client went away) cancels the request in the server.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backend.triton.params import get_bool_param

ENSEMBLE = "ensemble"
ENGINE = "hybrid_llm"  # the ensemble's engine step; a prefix cache reset goes to it directly
CONTROL_INPUTS = {"input_ids": "TYPE_INT32", "input_lengths": "TYPE_INT32",
                  "request_output_len": "TYPE_INT32", "reset_prefix_cache": "TYPE_BOOL",
                  "cache_salt": "TYPE_STRING", "load_lora": "TYPE_BOOL",
                  "unload_lora": "TYPE_BOOL", "lora_name": "TYPE_STRING",
                  "lora_path": "TYPE_STRING"}
_CONTROL = {"input_ids": 0, "input_lengths": 1, "request_output_len": 1}
RESET_COUNTS = ("dropped_pages", "kept_pages")
COUNTS = ("num_input_tokens", "num_output_tokens", "cached_tokens",
          "total_draft_tokens", "total_accepted_draft_tokens")  # the last two: perf metrics
DEFAULT_CONTEXT_LEN = 8192  # hybrid_llm's default max_context_len (backend/engine/config.py)
_MAX_MESSAGE = 256 << 20


class UpstreamError(Exception):
    """The server answered with an error, or could not be reached; `status` is the HTTP status
    for the client: 400 (the request's fault), 500 (the server's), 503 (unreachable, or
    `busy`: up, but its request queue is full, so another replica may take the request)."""

    def __init__(self, message: str, status: int = 500, busy: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.busy = busy


@dataclass
class Response:
    """One ensemble response: the row it carries (-1: all), each row's text, generated ids
    and finish reason, and the counts; with return_log_probs each row's log probabilities
    and (num_top_log_probs) the likeliest tokens at each one's position."""

    index: int
    texts: list[str]
    reasons: list[str]
    counts: dict[str, int] = field(default_factory=dict)
    final: bool = False
    ids: list[list[int]] = field(default_factory=list)
    log_probs: list[list[float]] = field(default_factory=list)
    tops: list[list[list[tuple[int, float]]]] = field(default_factory=list)
    # With return_prompt_log_probs, on the one response that carries them: the prompt's ids,
    # each one's log probability after the first, its rank there and its position's likeliest
    # tokens.
    prompt_ids: list[int] = field(default_factory=list)
    prompt_log_probs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_tops: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class ServedModel:
    input_types: dict[str, str]  # ensemble input -> config data_type (TYPE_INT32, ...)
    tokenizer_dir: Path | None
    model_dir: Path | None
    max_context_len: int
    add_special_tokens: bool = True  # preprocessing's, for prompts sent as token ids
    adapters: list[str] = field(default_factory=list)  # hybrid_llm's LoRA adapters' names

    @classmethod
    async def load(cls, upstream: Upstream, model_repository: str | Path) -> ServedModel:
        repo = Path(model_repository)
        ensemble = await upstream.model_config(upstream.model)
        types = {i["name"]: i["data_type"] for i in ensemble.get("input", [])}
        steps = [s.get("model_name") for s in
                 ensemble.get("ensemble_scheduling", {}).get("step", [])]
        tokenizer_dir = model_dir = None
        limit = DEFAULT_CONTEXT_LEN
        special = True
        adapters: list[str] = []
        own = _parameters(ensemble)
        if "ensemble_config" in own:  # hybrid_llm_bls: the ensemble's steps in one model
            steps = ["hybrid_llm"]
            if own.get("tokenizer_dir"):
                tokenizer_dir = repo / own["tokenizer_dir"]
            special = get_bool_param(ensemble, "add_special_tokens", True)
        if "preprocessing" in steps:
            config = await upstream.model_config("preprocessing")
            params = _parameters(config)
            if "tokenizer_dir" in params:
                tokenizer_dir = repo / params["tokenizer_dir"]
            special = get_bool_param(config, "add_special_tokens", True)  # as preprocessing
        if "hybrid_llm" in steps:
            params = _parameters(await upstream.model_config("hybrid_llm"))
            if "model_path" in params:
                model_dir = repo / "hybrid_llm" / params["model_path"]
            if params.get("max_context_len", "").isdigit():
                limit = int(params["max_context_len"])
            adapters = [entry.partition("=")[0].strip()  # "name=path,..." (the engine checks)
                        for entry in params.get("lora_adapters", "").split(",") if entry.strip()]
        if model_dir is not None:  # the engine also stops at the model's positions
            config = model_dir / "config.json"
            if config.is_file():
                data = json.loads(config.read_text(encoding="utf-8"))
                positions = data.get("max_position_embeddings") or data.get(
                    "text_config", {}).get("max_position_embeddings")
                if isinstance(positions, int) and positions > 0:
                    limit = min(limit, positions)
        return cls(types, tokenizer_dir or model_dir, model_dir, limit, special, adapters)


def _parameters(config: Mapping[str, Any]) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


class Upstream:
    def __init__(self, url: str, model: str = ENSEMBLE) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.url = url
        self.model = model  # what generation requests go to: the ensemble or hybrid_llm_bls
        self._pb = service_pb2
        self._channel = grpc.aio.insecure_channel(url, options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE)])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self.input_types: dict[str, str] = {}

    async def close(self) -> None:
        await self._channel.close()

    async def model_config(self, name: str) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict

        reply = await self._stub.ModelConfig(self._pb.ModelConfigRequest(name=name))
        return MessageToDict(reply.config, preserving_proto_field_name=True,
                             use_integers_for_enums=False)

    async def ready(self) -> bool:
        import grpc

        try:
            server = await self._stub.ServerReady(self._pb.ServerReadyRequest(), timeout=5)
            served = await self._stub.ModelReady(self._pb.ModelReadyRequest(name=self.model),
                                                 timeout=5)
        except grpc.RpcError:
            return False
        return bool(server.ready and served.ready)

    def request(self, fields: Mapping[str, Any], request_id: str | None = None,
                model: str | None = None, types: Mapping[str, str] | None = None) -> Any:
        """A ModelInferRequest for `model` (default `self.model`; dtypes from its config, or
        `types`), its id `request_id` (Triton's logs and traces name it) or a new one."""
        from tritonclient.utils import serialize_byte_tensor, triton_to_np_dtype

        model = self.model if model is None else model
        types = self.input_types if types is None else types
        request = self._pb.ModelInferRequest(model_name=model, id=request_id or uuid.uuid4().hex)
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        for name, value in fields.items():
            kind = types.get(name, "TYPE_STRING")  # config name: TYPE_INT32, ...
            wire = "BYTES" if kind == "TYPE_STRING" else kind.removeprefix("TYPE_")
            values = value if isinstance(value, (list, tuple)) else [value]
            if wire == "BYTES":
                array = np.array([[v.encode("utf-8") if isinstance(v, str) else v
                                   for v in values]], dtype=np.object_)
                raw = serialize_byte_tensor(array).item()
            else:
                array = np.array([values], dtype=triton_to_np_dtype(wire))
                raw = array.tobytes()
            request.inputs.add(name=name, datatype=wire, shape=list(array.shape))
            request.raw_input_contents.append(raw)
        return request

    async def generate(self, fields: Mapping[str, Any],
                       request_id: str | None = None) -> AsyncIterator[Response]:
        """The request's responses (the empty final one included) as they come; an error
        raises UpstreamError. Leaving the loop early cancels the request."""
        replies = self._stream(self.request(fields, request_id))
        async with contextlib.aclosing(replies):  # closed early: the stream is cancelled now
            async for result, response, final in replies:
                yield _response(result, response, final)

    async def reset_prefix_cache(self, cache_salt: str | None = None) -> dict[str, int]:
        """Asks the engine model to forget its cached prefixes (`cache_salt`: one namespace):
        {"dropped_pages", "kept_pages"}; an error raises UpstreamError."""
        fields: dict[str, Any] = {**_CONTROL, "reset_prefix_cache": True}
        if cache_salt is not None:
            fields["cache_salt"] = cache_salt
        counts = await self._control(fields)
        if set(counts) != set(RESET_COUNTS):
            raise UpstreamError(f"Triton at {self.url} answered the reset without "
                                "dropped_pages / kept_pages")
        return counts

    async def update_lora(self, action: str, name: str,
                          path: str | None = None) -> dict[str, int]:
        """Loads (`action` "load", from `path` on the server) or unloads LoRA adapter
        `name` (`allow_runtime_lora`); an unload answers {"dropped_pages"}. An error raises
        UpstreamError."""
        fields: dict[str, Any] = {**_CONTROL, f"{action}_lora": True, "lora_name": name}
        if path is not None:
            fields["lora_path"] = path
        return await self._control(fields)

    async def _control(self, fields: Mapping[str, Any]) -> dict[str, int]:
        """A control request to the engine model: the counts its answer carries."""
        counts: dict[str, int] = {}
        request = self.request(fields, model=ENGINE, types=CONTROL_INPUTS)
        async for result, response, _ in self._stream(request):
            names = {o.name for o in response.outputs}
            counts.update({n: int(result.as_numpy(n).reshape(-1)[0]) for n in RESET_COUNTS
                           if n in names})
        return counts

    async def _stream(self, request: Any) -> AsyncIterator[tuple[Any, Any, bool]]:
        """One request's (InferResult, response, final) over its own stream, up to the final
        one; errors raise UpstreamError; leaving early cancels the request."""
        import grpc
        from tritonclient.grpc import InferResult

        async def requests():
            yield request

        call = self._stub.ModelStreamInfer(requests())
        done = False
        try:
            async for reply in call:
                if reply.error_message:
                    done = True
                    message = reply.error_message
                    if QUEUE_FULL in message:  # hybrid_llm's max_queue_size (UNAVAILABLE)
                        raise UpstreamError(message, 503, busy=True)
                    raise UpstreamError(message, 400 if _invalid(message) else 500)
                response = reply.infer_response
                final = response.parameters["triton_final_response"].bool_param
                yield InferResult(response), response, final
                if final:
                    done = True
                    return
            done = True
            raise UpstreamError("the server closed the stream before the final response")
        except grpc.RpcError as exc:
            done = True
            unavailable = exc.code() == grpc.StatusCode.UNAVAILABLE
            raise UpstreamError(f"Triton at {self.url}: {exc.details()}",
                                503 if unavailable else 500) from None
        finally:
            if not done:
                call.cancel()


def _response(result: Any, response: Any, final: bool) -> Response:
    names = {o.name for o in response.outputs}

    def strings(name: str) -> list[str]:
        if name not in names:
            return []
        return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                for v in result.as_numpy(name).reshape(-1)]

    counts = {n: int(result.as_numpy(n).reshape(-1)[0]) for n in COUNTS if n in names}
    index = (int(result.as_numpy("sequence_index").reshape(-1)[0])
             if "sequence_index" in names else -1)
    out = Response(index, strings("text_output"), strings("finish_reason"), counts, final)
    log_probs = (result.as_numpy("output_log_probs")[0] if "output_log_probs" in names
                 else None)  # [K, N]: N = 0 without return_log_probs
    if {"output_ids", "sequence_length"} <= names:
        lengths = result.as_numpy("sequence_length")[0].tolist()
        ids = result.as_numpy("output_ids")[0]
        out.ids = [ids[k, :n].tolist() for k, n in enumerate(lengths)]
    if log_probs is not None and log_probs.shape[1] and out.ids:
        out.log_probs = [log_probs[k, :n].tolist() for k, n in enumerate(lengths)]
        if "top_log_prob_ids" in names and "top_log_probs" in names:
            top_ids = result.as_numpy("top_log_prob_ids")[0]  # [K, T, N]
            top_values = result.as_numpy("top_log_probs")[0]
            out.tops = [_alternatives(top_ids[k, :n], top_values[k, :n])
                        for k, n in enumerate(lengths)]
    if "prompt_token_ids" in names and result.as_numpy("prompt_token_ids").size:
        out.prompt_ids = result.as_numpy("prompt_token_ids").reshape(-1).tolist()
        out.prompt_log_probs = result.as_numpy("prompt_log_probs").reshape(-1).tolist()
        if "prompt_log_prob_ranks" in names:
            out.prompt_ranks = result.as_numpy("prompt_log_prob_ranks").reshape(-1).tolist()
        if "prompt_top_log_prob_ids" in names:
            out.prompt_tops = _alternatives(result.as_numpy("prompt_top_log_prob_ids")[0],
                                            result.as_numpy("prompt_top_log_probs")[0])
    return out


def _alternatives(ids: np.ndarray, values: np.ndarray) -> list[list[tuple[int, float]]]:
    """[T, N] ids (-1: padding) and log probabilities -> each position's (id, value)."""
    return [[(int(t), float(v)) for t, v in zip(row_ids, row_values) if t >= 0]
            for row_ids, row_values in zip(ids.tolist(), values.tolist())]


def _invalid(message: str) -> bool:
    """Whether a server error is the request's fault. Inside a stream an error comes as a
    message only; the models mark their own failures ("internal error: ...", the engine's
    "the engine failed", an unloaded model), the rest are INVALID_ARG (a bad value, a prompt
    over the context limit, a guide that does not compile) or Triton's own input checks."""
    return not any(marker in message for marker in _SERVER_FAULTS)


_SERVER_FAULTS = ("internal error", "the engine failed", "the model was unloaded")
# What the engine's refusal says when max_queue_size requests wait (`engine.QueueFull`).
QUEUE_FULL = "the request queue is full"
