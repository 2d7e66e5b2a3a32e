"""The OpenAI-compatible HTTP server (aiohttp) in front of a running Triton server.

    python -m backend.openai_api --triton-url 127.0.0.1:8001 --model-repository model_repo \
        --port 9000 [--served-model-name NAME ...] [--reasoning-parser qwen3] \
        [--tool-call-parser qwen|nemotron] [--triton-url URL2 --kv-events PUB[,REPLAY] ...]

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (server-sent events with `stream:
true`, ending with `data: [DONE]`), `GET /v1/models`, `GET /v1/models/{id}`, `POST
/v1/responses`, `GET` / `DELETE /v1/responses/{id}` (OpenAI's Responses API on the chat path,
`responses.py`), `GET /health/ready` (200 once Triton serves the ensemble; vLLM's `GET /health` and
SageMaker's `/ping` the same with an empty body), vLLM's `GET /version` and `POST
/tokenize` and `POST /detokenize` (the served tokenizer and chat template, no Triton request).
Each prompt is one ensemble request streamed from Triton (`upstream.py`), whatever the client
asked, so every choice's text is cut at its stop strings as it comes and its finish reason is
known, then (chat) split into reasoning (`reasoning.py`), content and tool calls (`tools.py`);
`usage` carries the prompt's `cached_tokens` (`prompt_tokens_details`, as OpenAI's): the
tokens served from the prefix cache. With several `--triton-url`s (replicas of one model),
each prompt goes to the replica whose prefix cache holds the longest part of it, as their
KV cache events say (`--kv-events`, `router.py`); `GET /router` shows the replicas' counts.
Errors are OpenAI error bodies: 400 for what the request
got wrong (the frontend's checks, `protocol.py`, and the server's INVALID_ARG), 404 for an
unknown model, 503 when Triton is not ready or its request queue is full (`max_queue_size`:
with replicas, the next best one gets the request first), 500 otherwise. A client that goes
away cancels its requests in Triton.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from aiohttp import web

from backend.cache.radix import lora_namespace
from backend.openai_api import protocol, responses
from backend.openai_api.chat import ChatTemplate
from backend.openai_api.metrics import GENERATION, FrontendMetrics
from backend.openai_api.protocol import Plan, RequestError, StopFilter, TokenLogprob, TokenNames
from backend.openai_api.reasoning import PARSERS, ReasoningReader
from backend.openai_api.router import Router, check_router_settings
from backend.openai_api.tools import LAYOUTS, QWEN, Layout, ToolStream
from backend.openai_api.upstream import ServedModel, Upstream, UpstreamError

log = logging.getLogger("backend.openai_api")


@dataclass
class State:
    upstream: Upstream
    served: ServedModel
    names: dict[str, str | None]  # what clients send as `model` -> its LoRA adapter or None
    tokenizer: Any  # backend.tokenizer.Tokenizer, or None (then max_tokens is required)
    template: ChatTemplate | None
    created: int = field(default_factory=lambda: int(time.time()))
    token_names: TokenNames | None = None  # for logprobs (with a tokenizer)
    id_names: TokenNames | None = None  # the same as `token_id:N` (return_tokens_as_token_ids)
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: every request's default
    reasoning_parser: str | None = None  # chat answers' <think> block -> reasoning_content
    tool_layout: Layout = QWEN  # --tool-call-parser: how the model writes its tool calls
    responses: responses.ResponseStore = field(default_factory=responses.ResponseStore)
    upstreams: list[Upstream] = field(default_factory=list)  # every replica (the first too)
    router: Router | None = None  # several replicas: which one serves a prompt
    metrics: FrontendMetrics = field(default_factory=FrontendMetrics)  # GET /metrics

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.token_names is None:
            self.token_names = TokenNames(self.tokenizer)
        if self.tokenizer is not None and self.id_names is None:
            self.id_names = TokenNames(self.tokenizer, by_id=True)


STATE = web.AppKey("state", State)


@dataclass
class Choice:
    stop: StopFilter
    parts: list[str] = field(default_factory=list)
    reason: str | None = None  # OpenAI's, once it ended
    stop_reason: str | int | None = None  # vLLM's: the stop string / token it ended at
    last_id: int | None = None  # the last id generated (a stop token's, where one ended it)
    raw: Any = None  # skip_special_tokens false: its ids decoded with special tokens written
    tail: str = ""  # with stop_token_ids: the last characters generated (before the filter)
    # With return_token_ids: every id it generated, and those no event carried yet
    token_ids: list[int] = field(default_factory=list)
    unsent_ids: list[int] = field(default_factory=list)
    tools: ToolStream | None = None  # a chat with tools: its text read as tool calls
    reasoning: ReasoningReader | None = None  # --reasoning-parser: its text split first
    # With logprobs: the choice's ids decoded as they come (where each token's text starts in
    # the choice's text, the echoed prompt included), the characters passed on so far, the
    # echoed prompt's tokens (sent with the first generated ones), the tokens whose text has
    # not been sent (held back by the stop filter) and those sent.
    decoder: Any = None
    decoded: int = 0
    sent: int = 0
    prompt: list[TokenLogprob] = field(default_factory=list)
    waiting: list[TokenLogprob] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def release(self) -> list[TokenLogprob]:
        """The prompt's tokens, then the waiting tokens whose text starts within what was
        sent; once the choice ended, the rest go (text cut at a stop string, or special
        tokens with no text)."""
        out = [e for e in self.waiting if e.offset < self.sent]
        self.waiting = [] if self.reason is not None else self.waiting[len(out):]
        out, self.prompt = self.prompt + out, []
        self.logprobs.extend(out)
        return out


class Event(NamedTuple):
    """A piece of one choice: the text (content) to send, its finish reason once it ended,
    the tokens (logprobs) that piece carries, tool-call deltas, reasoning text."""

    index: int
    text: str
    reason: str | None
    tokens: list[TokenLogprob]
    calls: list[dict[str, Any]]
    reasoning: str
    ids: Sequence[int] = ()  # with return_token_ids: the generated ids not sent yet


class Run:
    """The Triton requests of one OpenAI request (one a prompt) and its choices' progress."""

    def __init__(self, state: State, plan: Plan, arrived: float | None = None) -> None:
        self.state = state
        self.plan = plan
        self.arrived = time.perf_counter() if arrived is None else arrived
        self.first_at: float | None = None  # the first generated piece (perf_counter)
        self.last_at = 0.0  # the latest one
        protocol.prompt_texts(plan, state.tokenizer, state.served.add_special_tokens)
        protocol.check_logit_bias(plan, state.tokenizer)
        protocol.stop_token_texts(plan, state.tokenizer)
        # the generated text's end kept per choice to tell which stop token ended it
        self.tail_len = max(map(len, plan.stop_token_words), default=0)
        protocol.prediction_ids(plan, state.tokenizer)
        # vLLM's truncate_prompt_tokens: preprocessing keeps each prompt's last `keep` ids
        self.keep = None if plan.truncate is None else \
            state.served.max_context_len if plan.truncate == -1 else plan.truncate
        if self.keep is not None:
            plan.fields["truncate_prompt_tokens"] = self.keep
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(plan, name) is not None and state.token_names is None:
                raise RequestError(f"'{name}' needs the model's tokenizer, which the frontend "
                                   "did not find", name)
        # logprobs' token names: their text, or `token_id:N` (vLLM's return_tokens_as_token_ids)
        by_id = state.tokens_as_ids if plan.token_ids_named is None else plan.token_ids_named
        self.names = state.id_names if by_id else state.token_names
        # Each prompt's ids, tokenized once when something needs them (in the worker thread
        # that builds the run, not on the event loop).
        self._ids: dict[int, list[int] | None] = {}
        self.requests = [self._fields(i) for i in range(len(plan.prompts))]
        # vLLM's return_token_ids: each prompt's ids, as preprocessing tokenizes them
        self.prompt_token_ids = [self._prompt_ids(i) for i in range(len(plan.prompts))] \
            if plan.return_token_ids else []
        # Several replicas: each prompt's token ids, which the router hashes page by page.
        self.route_ids = [self._encoded(i) or [] for i in range(len(plan.prompts))] \
            if state.router is not None else []
        thinks = plan.kind == "chat" and state.reasoning_parser is not None
        tools = plan.tools
        calls = tools is not None and tools.choice != "none"
        call_start = state.tool_layout.start if calls and state.reasoning_parser == "qwen3" \
            else None
        self.choices = [Choice(StopFilter(plan.stop, keep=plan.include_stop),
                               tools=tools.stream(state.tool_layout) if tools else None,
                               reasoning=ReasoningReader.for_prompt(plan.prompts[i // plan.n],
                                                                    call_start)
                               if thinks else None)
                        for i in range(len(plan.prompts) * plan.n)]
        # The stop words that are one special token each, and the client's stop strings
        # among them (the engine stops at the token; the text shows it only with
        # skip_special_tokens false, where the stop filter then cuts it as any stop string)
        special = {} if state.tokenizer is None else \
            protocol.special_stop_ids(plan, state.tokenizer)
        self.stop_strings = {t: w for t, w in special.items() if w in plan.stop}
        self.hidden_stops = special.keys() - self.stop_strings.keys()  # left out of the text
        # vLLM's skip_special_tokens false: the text is written here from the ids, the
        # special tokens included but a special stop token that ended a choice (the chat
        # template's turn end, a special stop_token_ids token; vLLM leaves those out)
        if plan.keep_special:
            if state.tokenizer is None:
                raise RequestError("'skip_special_tokens': false needs the model's tokenizer, "
                                   "which the frontend did not find", "skip_special_tokens")
            for choice in self.choices:
                choice.raw = state.tokenizer.incremental_decoder(skip_special_tokens=False)
        if plan.logprobs is not None:
            for i, choice in enumerate(self.choices):
                choice.decoder = state.tokenizer.incremental_decoder()
                choice.decoded = choice.sent = len(self._echo(i))
        self.prompt_tokens = [0] * len(plan.prompts)
        # prompt_logprobs: per prompt, vLLM's list, once its response carried the scores
        self.prompt_scores: list[list | None] = [None] * len(plan.prompts)
        self.cached_tokens = [0] * len(plan.prompts)
        self.completion_tokens = 0
        # With a prediction: per (prompt, sequence), its draft tokens verified and kept so far
        self.drafts: dict[tuple[int, int], tuple[int, int]] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    def _encoded(self, i: int) -> list[int] | None:
        """Prompt i's ids as the model gets them (preprocessing's tokenization; the ids sent,
        for a token-id prompt; the last ones with truncate_prompt_tokens), None without a
        tokenizer; tokenized once."""
        if i not in self._ids:
            given = self.plan.prompt_ids[i] if i < len(self.plan.prompt_ids) else None
            tokenizer = self.state.tokenizer
            ids = list(given) if given is not None else None if tokenizer is None else \
                tokenizer.encode(self.plan.prompts[i],
                                 add_special_tokens=self.state.served.add_special_tokens)
            self._ids[i] = ids[-self.keep:] if ids is not None and self.keep else ids
        return self._ids[i]

    def _prompt_ids(self, i: int) -> list[int]:
        ids = self._encoded(i)
        if ids is None:
            raise RequestError("'return_token_ids' needs the model's tokenizer, which the "
                               "frontend did not find", "return_token_ids")
        return ids

    def _fields(self, i: int) -> dict[str, Any]:
        prompt = self.plan.prompts[i]
        max_tokens = self.plan.max_tokens
        if max_tokens is None:  # up to the context limit, as vLLM's default
            limit = self.state.served.max_context_len
            ids = self._encoded(i)
            if ids is None:
                raise RequestError("'max_tokens' is required (the frontend has no tokenizer "
                                   "to count the prompt)", "max_tokens")
            used = len(ids)
            max_tokens = limit - used
            if max_tokens < 1:
                raise RequestError(f"the prompt has {used} tokens, which leaves none of the "
                                   f"context limit of {limit} to generate", "messages")
        return {**self.plan.fields, "text_input": prompt, "max_tokens": max_tokens,
                "stream": True}

    def start(self) -> None:
        for p, fields in enumerate(self.requests):
            self.tasks.append(asyncio.create_task(self._pump(p, fields)))

    async def _pump(self, p: int, fields: dict[str, Any]) -> None:
        state = self.state
        if state.router is None:
            error = await self._relay(p, state.upstream, fields)
        else:  # several replicas: the best one; an unreachable one hands over to the next
            ids = self.route_ids[p]
            # the namespace the replicas cache it in: cache_salt, and its LoRA adapter
            salt = lora_namespace(fields.get("cache_salt") or "", fields.get("lora_name"))
            tried: list[int] = []
            while True:
                replica = state.router.pick(ids, salt, exclude=tried)
                try:
                    error = await self._relay(p, state.upstreams[replica], fields)
                finally:
                    state.router.done(replica)
                if error is None or error[1].status != 503:
                    break
                if not error[1].busy:  # unreachable; a full queue is no failure
                    state.router.failed(replica)
                tried.append(replica)
                if error[0] or len(tried) == len(state.upstreams):
                    break  # it had answered (no second try), or none is left
        if error is not None:
            await self.queue.put((p, None, error[1]))
            return
        await self.queue.put((p, None, None))  # this prompt's requests are done

    async def _relay(self, p: int, upstream: Upstream,
                     fields: dict[str, Any]) -> tuple[bool, UpstreamError] | None:
        """Puts the prompt's responses from `upstream` on the queue; its error (and whether
        any response came before it), None when all came."""
        answered = False
        try:
            async for response in upstream.generate(fields, self.triton_id(p)):
                answered = True
                await self.queue.put((p, response, None))
        except UpstreamError as exc:
            return answered, exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken channel: reported to the client, not raised here
            return answered, UpstreamError(f"{type(exc).__name__}: {exc}")
        return None

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def events(self):
        """An `Event` per piece of a choice as the responses come; an upstream error raises
        it."""
        closed: set[int] = set()  # prompts whose requests ended (or were cancelled)
        n = self.plan.n
        while len(closed) < len(self.requests):
            p, response, error = await self.queue.get()
            if error is not None:
                raise error
            if response is None:
                closed.add(p)
                continue
            if response.prompt_ids and self.plan.echo and self.plan.logprobs is not None:
                self._score_prompt(p, response)
            if response.prompt_ids and self.plan.prompt_logprobs is not None:
                self.prompt_scores[p] = protocol.prompt_logprobs_body(
                    self.state.token_names, response.prompt_ids, response.prompt_log_probs,
                    response.prompt_ranks, response.prompt_tops, self.plan.prompt_logprobs)
            if self.plan.beam and not any(response.reasons):
                continue  # a beam search's running beams (it streams them: cancellable)
            counts = response.counts
            if "num_input_tokens" in counts:
                self.prompt_tokens[p] = counts["num_input_tokens"]
            self.completion_tokens += counts.get("num_output_tokens", 0)
            if response.index in (0, -1) and "cached_tokens" in counts:
                self.cached_tokens[p] = counts["cached_tokens"]
            if "total_draft_tokens" in counts:  # each sequence's so far
                self.drafts[p, response.index] = (counts["total_draft_tokens"],
                                                  counts.get("total_accepted_draft_tokens", 0))
            for k, text in enumerate(response.texts):
                engine_reason = response.reasons[k] if k < len(response.reasons) else ""
                index = p * n + k
                choice = self.choices[index]
                if choice.reason is not None:
                    continue
                if choice.decoder is not None and k < len(response.ids):
                    self._score(choice, response, k)
                if k < len(response.ids) and response.ids[k]:
                    choice.last_id = response.ids[k][-1]
                    if self.plan.return_token_ids:
                        choice.token_ids += response.ids[k]
                        choice.unsent_ids += response.ids[k]
                if choice.raw is not None:
                    text = self._raw_text(choice, response.ids[k] if k < len(response.ids)
                                          else [], engine_reason, whole=response.index == -1)
                if not (text or engine_reason):
                    continue
                if self.tail_len:
                    choice.tail = (choice.tail + text)[-self.tail_len:]
                out = choice.stop.feed(text)
                if choice.stop.stopped or engine_reason:
                    out += choice.stop.flush()
                    choice.reason = protocol.finish_reason(engine_reason, choice.stop.stopped)
                    choice.stop_reason = protocol.stop_reason(
                        engine_reason, choice.stop, choice.tail, self.plan.stop_token_words,
                        choice.last_id, self.stop_strings)
                yield self._noted(self._read(index, choice, out))
                if choice.stop.stopped and p not in closed and self._prompt_done(p):
                    self.tasks[p].cancel()  # every choice of it ended at a stop string
                    closed.add(p)
        for index, choice in enumerate(self.choices):  # ended without a reason: say why
            if choice.reason is None:
                choice.reason = "stop"
                yield self._noted(self._read(index, choice, choice.stop.flush()))

    def _raw_text(self, choice: Choice, ids: list[int], engine_reason: str,
                  whole: bool) -> str:
        """skip_special_tokens false: the text of a row's `ids` with special tokens written
        (`whole`: the row holds the choice's every id, a beam or a non-streamed answer), less
        a special stop word's token that ended the choice."""
        if engine_reason == "stop" and ids and ids[-1] in self.hidden_stops:
            ids = ids[:-1]
        if whole:
            return self.state.tokenizer.decode(ids, skip_special_tokens=False)
        text = choice.raw.push(ids)
        return text + choice.raw.flush() if engine_reason else text

    def triton_id(self, p: int) -> str:
        """Prompt `p`'s Triton request id: the response's id without its prefix (the
        client's X-Request-Id where it sent one), `-p` after it with several prompts."""
        base = self.plan.request_id
        return base if len(self.requests) == 1 else f"{base}-{p}"

    def _noted(self, event: Event) -> Event:
        """`event`, its time noted where it carries something generated."""
        if event.text or event.calls or event.reasoning:
            self.last_at = time.perf_counter()
            if self.first_at is None:
                self.first_at = self.last_at
        return event

    def report(self, endpoint: str) -> None:
        """Its timings and token counts into the frontend's metrics (once it is over)."""
        ttft = None if self.first_at is None else self.first_at - self.arrived
        after = 0.0 if self.first_at is None else self.last_at - self.first_at
        self.state.metrics.answered(endpoint, ttft, after, self.usage())

    @staticmethod
    def _read(index: int, choice: Choice, text: str) -> Event:
        """Text past the stop filter -> its reasoning, the content to send and tool-call
        deltas (all of it is "sent" for its tokens' logprobs, whatever it becomes); once
        the choice ended, what the readers held and its finish reason."""
        choice.sent += len(text)
        calls: list[dict[str, Any]] = []
        reasoning = ""
        if choice.reasoning is not None:
            reasoning, text = choice.reasoning.feed(text)
            if choice.reason is not None:
                more, rest = choice.reasoning.finish()
                reasoning, text = reasoning + more, text + rest
        if choice.tools is not None:
            text, calls = choice.tools.feed(text)
            if choice.reason is not None:
                rest, done = choice.tools.finish()
                text, calls = text + rest, calls + done
                choice.reason = choice.tools.finish_reason(choice.reason)
        choice.parts.append(text)
        ids, choice.unsent_ids = choice.unsent_ids, []
        return Event(index, text, choice.reason, choice.release(), calls, reasoning, ids)

    def _score(self, choice: Choice, response: Any, k: int) -> None:
        """Row k's tokens, each where its text starts in the choice's text, waiting for
        their text to be sent."""
        tops = response.tops[k] if k < len(response.tops) else []
        top = self.plan.logprobs or 0  # the engine's count may be prompt_logprobs' (larger)
        log_probs = response.log_probs[k] if k < len(response.log_probs) else []
        for i, (token, logprob) in enumerate(zip(response.ids[k], log_probs)):
            offset = choice.decoded
            choice.decoded += len(choice.decoder.push(token))
            choice.waiting.append(self.names.entry(
                token, logprob, offset, tops[i][:top] if i < len(tops) else ()))

    def _score_prompt(self, p: int, response: Any) -> None:
        """Prompt p's tokens (echo with logprobs), placed in its text as decoded with its
        special tokens (the echo shows them), for each of its choices."""
        decoder = self.state.tokenizer.incremental_decoder(skip_special_tokens=False)
        names, entries, offset = self.names, [], 0
        tops = response.prompt_tops
        for i, token in enumerate(response.prompt_ids):
            logprob = None if i == 0 else response.prompt_log_probs[i - 1]
            top = tops[i - 1][:self.plan.logprobs or 0] if 0 < i <= len(tops) else ()
            entries.append(names.entry(token, logprob, offset, top))
            offset += len(decoder.push(token))
        n = self.plan.n
        for choice in self.choices[p * n:(p + 1) * n]:
            choice.prompt = list(entries)

    def logprobs(self) -> list[dict[str, Any] | None]:
        """Every choice's `logprobs` (non-streamed answers)."""
        return [protocol.logprobs_body(self.plan, c.logprobs) for c in self.choices]

    def _echo(self, index: int) -> str:
        """Choice `index`'s text before what it generates (its prompt, with echo)."""
        return self.plan.prompts[index // self.plan.n] if self.plan.echo else ""

    def _prompt_done(self, p: int) -> bool:
        n = self.plan.n
        return all(c.reason is not None for c in self.choices[p * n:(p + 1) * n])

    def usage(self) -> dict[str, Any]:
        predicted = None
        if "draft_input_ids" in self.plan.fields:
            drafts = sum(d for d, _ in self.drafts.values())
            kept = sum(k for _, k in self.drafts.values())
            predicted = (kept, drafts - kept)
        return protocol.usage(sum(self.prompt_tokens), self.completion_tokens,
                              sum(self.cached_tokens), predicted)

    def texts(self) -> list[str | None]:
        """Each choice's text (chat with tool calls: its content, None where only calls)."""
        return [c.tools.content if c.tools is not None else self._echo(i) + "".join(c.parts)
                for i, c in enumerate(self.choices)]

    def calls(self) -> list[list[dict[str, Any]]]:
        return [c.tools.calls if c.tools is not None else [] for c in self.choices]

    def reasoning(self) -> list[str | None] | None:
        """Each chat choice's reasoning (None: no reasoning parser)."""
        if not any(c.reasoning is not None for c in self.choices):
            return None
        return [c.reasoning.reasoning for c in self.choices]


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = await _body(request)
        plan = (protocol.parse_chat(body, state.names, state.template) if kind == "chat"
                else protocol.parse_completion(body, state.names))
        plan.request_id = _request_id(request, body) or plan.request_id
        # Token-id prompts and the chat default max_tokens tokenize: off the event loop.
        run = await asyncio.to_thread(Run, state, plan, request.get(ARRIVED))
    except RequestError as exc:
        return _error(exc)
    run.start()
    events = run.events()
    try:
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except UpstreamError as exc:
            return _error(_client_error(exc))
        if plan.stream:
            return await _stream(request, run, events, first)
        if first is not None:
            async for _ in events:
                pass
        reasons = [c.reason or "stop" for c in run.choices]
        return web.json_response(protocol.response_body(
            plan, run.texts(), reasons, run.usage(), run.logprobs(), run.calls(),
            run.reasoning(), run.prompt_scores if plan.prompt_logprobs is not None else None,
            [c.stop_reason for c in run.choices],
            [c.token_ids for c in run.choices] if plan.return_token_ids else None,
            run.prompt_token_ids if plan.return_token_ids else None),
            headers={REQUEST_ID: plan.request_id})
    except UpstreamError as exc:
        return _error(_client_error(exc))
    finally:
        run.cancel()
        await events.aclose()
        run.report(request.path)


async def _stream(request: web.Request, run: Run, events, first) -> web.StreamResponse:
    plan = run.plan
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           REQUEST_ID: plan.request_id})
    await response.prepare(request)

    async def send(body: Any) -> None:
        await response.write(f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode())

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        """A chunk of one choice; with continuous_usage_stats (vLLM's), the usage so far."""
        return protocol.chunk_body(plan, [choice], run.usage() if plan.continuous_usage
                                   else None)

    # return_token_ids: the prompt's ids go on a completion choice's first chunk, on a
    # chat's first (role) chunk
    unnamed = set(range(len(run.choices))) if plan.return_token_ids else set()

    def prompt_ids(index: int) -> list[int] | None:
        if index not in unnamed:
            return None
        unnamed.discard(index)
        return run.prompt_token_ids[index // plan.n]

    for index in range(len(run.choices)):  # the role (chat) or the echoed prompt first
        if plan.kind == "chat":
            body = chunk(protocol.stream_choice(plan, index, "", None, role=True))
            if index == 0 and plan.return_token_ids:
                body["prompt_token_ids"] = run.prompt_token_ids[0]
            await send(body)
        elif plan.echo:
            echo = plan.prompts[index // plan.n]
            await send(chunk(protocol.stream_choice(plan, index, echo, None,
                                                    prompt_token_ids=prompt_ids(index))))
    try:
        pending = [first] if first is not None else []
        while True:
            for e in pending:
                if e.text or e.reason or e.tokens or e.calls or e.reasoning or e.ids:
                    logprobs = protocol.logprobs_body(plan, e.tokens)
                    await send(chunk(protocol.stream_choice(
                        plan, e.index, e.text, e.reason, logprobs=logprobs, calls=e.calls,
                        reasoning=e.reasoning, stop_reason=run.choices[e.index].stop_reason,
                        token_ids=list(e.ids) if plan.return_token_ids else None,
                        prompt_token_ids=prompt_ids(e.index))))
            try:
                pending = [await events.__anext__()]
            except StopAsyncIteration:
                break
        if plan.include_usage:
            await send(protocol.chunk_body(plan, [], run.usage()))
    except UpstreamError as exc:
        await send(_client_error(exc).body())
    except ConnectionResetError:  # the client went away: its requests are cancelled
        return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def create_response(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: the request as a chat completion (`responses.py`)."""
    state = request.app[STATE]
    try:
        body = await _body(request)
        conv, plan = responses.parse(body, state.responses, state.names, state.template)
        run = await asyncio.to_thread(Run, state, plan, request.get(ARRIVED))
    except RequestError as exc:
        return _error(exc)
    builder = responses.ResponseBuilder(conv, plan.model)
    run.start()
    events = run.events()
    response: web.StreamResponse | None = None

    async def send(event: dict[str, Any]) -> None:
        if response is not None:
            await response.write(f"event: {event['type']}\ndata: "
                                 f"{json.dumps(event, ensure_ascii=False)}\n\n".encode())

    try:
        try:
            piece = await events.__anext__()  # an error before any text: a plain error body
        except StopAsyncIteration:
            piece = None
        if conv.stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await response.prepare(request)
        for event in builder.start():
            await send(event)
        reason = "stop"
        while piece is not None:
            reason = piece.reason or reason
            for event in builder.feed(piece.reasoning, piece.text, piece.calls):
                await send(event)
            try:
                piece = await events.__anext__()
            except StopAsyncIteration:
                piece = None
        thought = run.reasoning()
        counted = len(state.tokenizer.encode(thought[0], add_special_tokens=False)) \
            if thought and thought[0] and state.tokenizer is not None else 0
        for event in builder.finish(reason, run.usage(), counted):
            await send(event)
        if conv.store:
            state.responses.put(conv.id, responses.Stored(conv.history + [builder.answer()],
                                                          builder.body))
        if response is None:
            return web.json_response(builder.body)
        await response.write_eof()
        return response
    except UpstreamError as exc:
        error = _client_error(exc)
        if response is None:
            return _error(error)
        await send({"type": "error", "code": error.code, "message": error.message,
                    "param": error.param})
        await response.write_eof()
        return response
    except ConnectionResetError:  # the client went away: its requests are cancelled
        return response
    finally:
        run.cancel()
        await events.aclose()
        run.report(request.path)


async def stored_response(request: web.Request) -> web.Response:
    """`GET` / `DELETE /v1/responses/{id}`: a stored response, or forget it."""
    state = request.app[STATE]
    rid = request.match_info["id"]
    stored = state.responses.get(rid)
    if stored is None:
        return _error(RequestError(f"response {rid!r} not found", "id", 404, code="not_found"))
    if request.method == "DELETE":
        state.responses.delete(rid)
        return web.json_response({"id": rid, "object": "response", "deleted": True})
    return web.json_response(stored.body)


def _client_error(exc: UpstreamError) -> RequestError:
    if exc.status == 400:
        return RequestError(exc.message)
    kind = "service_unavailable" if exc.status == 503 else "internal_server_error"
    return RequestError(f"the inference server failed: {exc.message}", status=exc.status,
                        kind=kind)


def _error(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _body(request)
        return web.json_response(await asyncio.to_thread(
            protocol.tokenize_body, body, state.names, state.tokenizer, state.template,
            state.served.max_context_len, state.token_names))
    except RequestError as exc:
        return _error(exc)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _body(request)
        return web.json_response(protocol.detokenize_body(body, state.names, state.tokenizer))
    except RequestError as exc:
        return _error(exc)


REQUEST_ID = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # (fullmatch: "$" takes a final \n)


def _request_id(request: web.Request, body: Any) -> str | None:
    """The client's id for a completion (vLLM's `request_id` field, or an X-Request-Id
    header): the response's id after its prefix and the Triton request's id; None: none."""
    given = body.get("request_id") if isinstance(body, dict) else None
    where = "request_id"
    if given is None:
        given, where = request.headers.get(REQUEST_ID), REQUEST_ID
    if given is None:
        return None
    if not isinstance(given, str) or not _REQUEST_ID.fullmatch(given):
        raise RequestError(f"'{where}' must be 1 to 128 letters, digits or . _ : -, got "
                           f"{given!r:.80}", where)
    return given


async def _body(request: web.Request) -> Any:
    """The request's JSON; a 400 for a body that is not JSON, nests too deeply to parse, or
    holds a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, but no text a tokenizer can
    take)."""
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise RequestError("the request body is not valid JSON") from None
    except RecursionError:
        raise RequestError("the request body nests JSON too deeply") from None
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("the request body holds a lone UTF-16 surrogate "
                                   f"({value!r:.40}): not text") from None
    return body


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model(state, n) for n in state.names]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.names:
        return _error(RequestError(f"the model {name!r} does not exist", "model", 404,
                                   code="model_not_found"))
    return web.json_response(_model(state, name))


def _model(state: State, name: str) -> dict[str, Any]:
    entry = {"id": name, "object": "model", "created": state.created,
             "owned_by": "suffixreplay", "max_model_len": state.served.max_context_len}
    if state.names.get(name):  # a LoRA adapter: its base model, as vLLM lists adapters
        entry["parent"] = next(n for n, adapter in state.names.items() if adapter is None)
    return entry


async def _serving(state: State) -> bool:
    """Whether a replica serves the ensemble (the router passes over the others)."""
    return any(await asyncio.gather(*(u.ready() for u in state.upstreams)))


async def health_ready(request: web.Request) -> web.Response:
    """200 while a replica serves the ensemble."""
    ready = await _serving(request.app[STATE])
    return web.Response(status=200 if ready else 503, text="ready" if ready else "not ready")


async def health(request: web.Request) -> web.Response:
    """vLLM's `GET /health` and SageMaker's `GET|POST /ping`: 200 with an empty body while a
    replica serves the ensemble, else 503 (the probes load balancers and orchestrators use)."""
    return web.Response(status=200 if await _serving(request.app[STATE]) else 503)


async def version(request: web.Request) -> web.Response:
    """vLLM's `GET /version`: this package's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        number = installed("suffixreplay")
    except PackageNotFoundError:  # run from a checkout that was not installed
        number = "unknown"
    return web.json_response({"version": number})


def _replicas(state: State) -> list[dict[str, Any]]:
    """Each replica: its URL and the router's counts for it (none with one replica)."""
    counts = state.router.stats() if state.router is not None else [{}] * len(state.upstreams)
    return [{"url": u.url, **c} for u, c in zip(state.upstreams, counts)]


async def router_stats(request: web.Request) -> web.Response:
    """Each replica: its URL, requests routed to it, in flight, pages its events announced."""
    return web.json_response({"replicas": _replicas(request.app[STATE])})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """`POST /reset_prefix_cache` (vLLM's route; `--enable-cache-reset`): every replica
    forgets its cached prefixes on every tier (`?cache_salt=S` or a JSON body's
    `cache_salt`: that namespace's only); pages running requests hold stay. 200 with each
    replica's dropped / kept pages, or the status of the first replica that failed."""
    state = request.app[STATE]
    salt = request.query.get("cache_salt")
    if salt is None and request.can_read_body:
        try:
            salt = protocol.json_object(await _body(request)).get("cache_salt")
        except RequestError as exc:
            return _error(exc)
        if salt is not None and not isinstance(salt, str):
            return _error(RequestError("cache_salt must be a string", "cache_salt"))
    replicas, failed = await _on_every_replica(state, lambda u: u.reset_prefix_cache(salt))
    totals = {n: sum(r.get(n, 0) for r in replicas) for n in ("dropped_pages", "kept_pages")}
    log.info("prefix cache reset (%s): %s", "every namespace" if salt is None else
             f"cache_salt {salt!r}", replicas)
    return web.json_response({"cache_salt": salt, **totals, "replicas": replicas},
                             status=failed.status if failed else 200)


async def _on_every_replica(state: State, call) -> tuple[list[dict[str, Any]],
                                                          UpstreamError | None]:
    """`call(upstream)` on every replica at once: each one's URL with its answer (a dict)
    or its error, and the first error (None: all answered)."""
    results = await asyncio.gather(*(call(u) for u in state.upstreams),
                                   return_exceptions=True)
    replicas, failed = [], None
    for upstream, result in zip(state.upstreams, results):
        if isinstance(result, UpstreamError):
            replicas.append({"url": upstream.url, "error": result.message})
            failed = failed or result
        elif isinstance(result, BaseException):
            raise result
        else:
            replicas.append({"url": upstream.url, **result})
    return replicas, failed


async def load_lora_adapter(request: web.Request) -> web.Response:
    """`POST /v1/load_lora_adapter` (vLLM's route; `--enable-lora-updates`): body
    {"lora_name", "lora_path"}: every replica loads the adapter (the path on its server),
    which is then a model clients can name. 200, or the first failing replica's status (the
    replicas that loaded it unload it again: all or none hold it)."""
    return await _update_lora(request, "load")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """`POST /v1/unload_lora_adapter` (vLLM's route): body {"lora_name"}: every replica
    stops serving it (refused while requests on it run) and the name is no model now. A
    replica that does not hold it has nothing to do (a retry after a partial unload; an
    adapter loaded before this frontend started); 404 when none holds it."""
    return await _update_lora(request, "unload")


UNKNOWN_ADAPTER = "unknown LoRA adapter"  # (a replica's answer: Engine.unload_lora)


async def _update_lora(request: web.Request, action: str) -> web.Response:
    state = request.app[STATE]
    try:
        body = protocol.json_object(await _body(request))
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError("'lora_name' must be a non-empty string", "lora_name")
        path = body.get("lora_path")
        if action == "load" and (not isinstance(path, str) or not path):
            raise RequestError("'lora_path' must be the adapter's folder on the server",
                               "lora_path")
        if action == "load" and name in state.names:
            raise RequestError(f"the model {name!r} already exists", "lora_name")
        if action == "unload" and name in state.names and not state.names[name]:
            raise RequestError(f"{name!r} is not a LoRA adapter of this server", "lora_name",
                               404)
    except RequestError as exc:
        return _error(exc)
    replicas, failed = await _on_every_replica(
        state, lambda u: u.update_lora(action, name, path if action == "load" else None))
    if action == "unload":  # a replica without it (an earlier unload got that far, or a
        # name this frontend never heard of: loaded before it started) has nothing to do
        gone = [r for r in replicas if UNKNOWN_ADAPTER in r.get("error", "")]
        if len(gone) == len(replicas):
            state.names.pop(name, None)
            return _error(RequestError(f"{name!r} is not a LoRA adapter of this server",
                                       "lora_name", 404))
        for r in gone:
            del r["error"]
            r["held"] = False
        errors = [r["error"] for r in replicas if "error" in r]
        failed = UpstreamError(errors[0], failed.status) if errors and failed else None
    if failed and action == "load":  # none or some loaded it: the ones that did unload it
        done = [u for u, r in zip(state.upstreams, replicas) if "error" not in r]
        undone = await asyncio.gather(*(u.update_lora("unload", name) for u in done),
                                      return_exceptions=True)
        kept = sum(isinstance(r, BaseException) for r in undone)
        return _error(RequestError(
            f"load of LoRA adapter {name!r}: {failed.message}" + (
                f" (unloaded again from the {len(done) - kept} replica(s) that had loaded it)"
                if done else "") + (f"; {kept} replica(s) still hold it" if kept else ""),
            "lora_name", failed.status))
    if failed:  # some replicas unloaded it, some not: a retry finishes it
        return _error(RequestError(
            f"unload of LoRA adapter {name!r}: {failed.message} (the replicas that had no "
            "error unloaded it; retry once its requests finished)", "lora_name",
            failed.status))
    if action == "load":
        state.names[name] = name
    else:
        state.names.pop(name, None)
    log.info("LoRA adapter %r %sed: %s", name, action, replicas)
    return web.json_response({"lora_name": name, "action": action, "replicas": replicas})


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: the frontend's Prometheus metrics (`metrics.py`)."""
    state = request.app[STATE]
    replicas = _replicas(state) if state.router is not None else []
    return web.Response(text=state.metrics.text(replicas),
                        content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


ARRIVED = "arrived"  # the request's arrival (perf_counter), set by `observed`


@web.middleware
async def observed(request: web.Request, handler) -> web.StreamResponse:
    """Counts every request by route and status; times generation requests."""
    request[ARRIVED] = time.perf_counter()
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    generation = request.method == "POST" and endpoint in GENERATION
    table = request.app[STATE].metrics
    if generation:
        table.started(endpoint)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        table.finished(endpoint, status,
                       time.perf_counter() - request[ARRIVED] if generation else None)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown route, wrong method) as OpenAI error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(RequestError(f"{request.method} {request.path}: {exc.reason}",
                                   status=exc.status))


async def make_app(triton_url: str | Sequence[str], model_repository: str | Path,
                   served_names: Sequence[str] = (),
                   reasoning_parser: str | None = None,
                   tool_call_parser: str = "qwen",
                   kv_events: Sequence[str] = (), max_imbalance: int = 16,
                   down_s: float = 5.0, enable_cache_reset: bool = False,
                   enable_lora_updates: bool = False,
                   triton_model: str = "ensemble",
                   return_tokens_as_token_ids: bool = False) -> web.Application:
    """The app, connected to Triton (its configuration read once, from the first URL);
    several URLs: replicas of one model, routed by their KV cache events (`kv_events`, one
    "PUB[,REPLAY]" a replica, in the same order; fewer: the rest have none)."""
    urls = [triton_url] if isinstance(triton_url, str) else list(triton_url)
    if len(kv_events) > len(urls):
        raise ValueError(f"{len(kv_events)} --kv-events for {len(urls)} --triton-url")
    if reasoning_parser is not None and reasoning_parser not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got "
                         f"{reasoning_parser!r}")
    if tool_call_parser not in LAYOUTS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(LAYOUTS)}, got "
                         f"{tool_call_parser!r}")
    import grpc

    from backend.tokenizer import load_tokenizer

    upstreams = [Upstream(url, triton_model) for url in urls]
    served = None
    for upstream in upstreams:  # the configuration from the first replica that answers
        try:
            served = await ServedModel.load(upstream, model_repository)
            break
        except grpc.RpcError as exc:
            if upstream is upstreams[-1]:
                raise SystemExit(f"no replica answered: Triton at {upstream.url}: "
                                 f"{exc.details()}") from None
            log.warning("Triton at %s: %s; reading the configuration from the next replica",
                        upstream.url, exc.details())
    for u in upstreams:
        u.input_types = served.input_types
    tokenizer = template = None
    if served.tokenizer_dir is not None and served.tokenizer_dir.is_dir():
        tokenizer = load_tokenizer(served.tokenizer_dir)
        template = ChatTemplate.from_dir(served.tokenizer_dir, tokenizer.special_tokens)
    else:
        log.warning("no tokenizer folder under %s: chat and a missing max_tokens are refused",
                    model_repository)
    app = web.Application(middlewares=[observed, json_errors], client_max_size=64 << 20)
    # Served names -> the LoRA adapter each stands for (None: the base model).
    names: dict[str, str | None] = dict.fromkeys(list(served_names) or [triton_model])
    names.update({adapter: adapter for adapter in served.adapters})
    app[STATE] = State(upstream, served, names, tokenizer,
                       template, reasoning_parser=reasoning_parser,
                       tool_layout=LAYOUTS[tool_call_parser], upstreams=upstreams,
                       router=Router(len(urls), kv_events, max_imbalance, down_s)
                       if len(urls) > 1 else None,
                       tokens_as_ids=return_tokens_as_token_ids)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{id}", stored_response)
    app.router.add_delete("/v1/responses/{id}", stored_response)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health/ready", health_ready)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/router", router_stats)
    app.router.add_get("/metrics", metrics)
    if enable_cache_reset:  # an admin action: off unless asked for (as vLLM's dev mode)
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    if enable_lora_updates:  # likewise (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)

    async def close(app: web.Application) -> None:
        state = app[STATE]
        if state.router is not None:
            state.router.close()
        for u in state.upstreams:
            await u.close()

    app.on_cleanup.append(close)
    return app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backend.openai_api",
                                     description="OpenAI-compatible frontend for the ensemble")
    parser.add_argument("--triton-url", action="append", default=[],
                        help="Triton's gRPC address (default 127.0.0.1:8001); more than one: "
                             "replicas of one model, each prompt sent to the one that has the "
                             "most of it cached")
    parser.add_argument("--kv-events", action="append", default=[], metavar="PUB[,REPLAY]",
                        help="a replica's kv_events_endpoint (and replay endpoint), one per "
                             "--triton-url in the same order, e.g. "
                             "tcp://10.0.0.2:5557,tcp://10.0.0.2:5558")
    parser.add_argument("--model-repository", default="model_repo",
                        help="the folder Triton serves (for the tokenizer and chat template)")
    parser.add_argument("--triton-model", default="ensemble",
                        help="the Triton model generation requests go to: ensemble, or "
                             "hybrid_llm_bls (the same contract in one model: its streams "
                             "finish when Triton is told to stop)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="name(s) clients use as `model` (default: ensemble)")
    parser.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                        help="split a thinking model's <think> block into the chat answer's "
                             "reasoning_content (qwen3: Qwen3 / Qwen3.5; deepseek_r1: the "
                             "same rule)")
    parser.add_argument("--tool-call-parser", choices=list(LAYOUTS), default="qwen",
                        help="how the model writes tool calls, read for tool_choice auto "
                             "(qwen: <tool_call> blocks of Hermes JSON or Qwen3-Coder XML, "
                             "Qwen3 / Qwen3-Next / Qwen3.5 / Nemotron 3; nemotron: "
                             "<TOOLCALL>[...]</TOOLCALL>, Nemotron Nano 2; hermes, qwen3_coder, "
                             "qwen3_xml and nemotron_json are vLLM's names for them)")
    parser.add_argument("--router-max-imbalance", type=int, default=16, metavar="N",
                        help="several replicas: one with more than N requests in flight beyond "
                             "the least busy one gets none until that evens out, however much "
                             "of a prompt it has cached")
    parser.add_argument("--router-down-s", type=float, default=5.0, metavar="S",
                        help="several replicas: one that cannot be reached is passed over for "
                             "S seconds (its requests go to the next best replica)")
    parser.add_argument("--enable-cache-reset", action="store_true",
                        help="serve POST /reset_prefix_cache (vLLM's admin route): every "
                             "replica forgets its cached prefixes (?cache_salt=S: one "
                             "namespace's); off by default, as any client could call it")
    parser.add_argument("--enable-lora-updates", action="store_true",
                        help="serve vLLM's POST /v1/load_lora_adapter and "
                             "/v1/unload_lora_adapter (the replicas need allow_runtime_lora); "
                             "off by default, as any client could call them")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name each token `token_id:N` (vLLM's flag; a request's "
                             "return_tokens_as_token_ids overrides it)")
    parser.add_argument("--wait-s", type=float, default=120.0,
                        help="how long to wait at start for Triton (one replica) to be ready")
    args = parser.parse_args(argv)
    args.triton_url = args.triton_url or ["127.0.0.1:8001"]
    if len(args.kv_events) > len(args.triton_url):
        parser.error(f"{len(args.kv_events)} --kv-events for {len(args.triton_url)} "
                     "--triton-url")
    if not Path(args.model_repository).is_dir():  # where the tokenizer is found
        parser.error(f"--model-repository {args.model_repository}: no such folder")
    try:
        check_router_settings(args.router_max_imbalance, args.router_down_s)
    except ValueError as exc:
        parser.error(f"--{exc}")
    return args


def _check_port_free(host: str, port: int) -> None:
    """Exits with one line when `host:port` cannot be listened on (taken, not this host's),
    before waiting for Triton, instead of a traceback after it."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in infos[:1]:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on {host}:{port}: "
                         f"{exc.strerror or exc}") from None


async def _wait_ready(urls: Sequence[str], wait_s: float, model: str) -> None:
    """Waits until one of `urls` serves `model` (the others may come later: the router
    passes over them until they do)."""
    upstreams = [Upstream(url, model) for url in urls]
    try:
        deadline = time.monotonic() + wait_s
        while not any(await asyncio.gather(*(u.ready() for u in upstreams))):
            if time.monotonic() > deadline:
                raise SystemExit(f"Triton at {', '.join(urls)} did not serve {model} "
                                 f"within {wait_s} s")
            await asyncio.sleep(0.5)
    finally:
        for upstream in upstreams:
            await upstream.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    async def build() -> web.Application:
        await _wait_ready(args.triton_url, args.wait_s, args.triton_model)
        return await make_app(args.triton_url, args.model_repository, args.served_model_name,
                              args.reasoning_parser, args.tool_call_parser, args.kv_events,
                              args.router_max_imbalance, args.router_down_s,
                              args.enable_cache_reset, args.enable_lora_updates,
                              args.triton_model, args.return_tokens_as_token_ids)

    _check_port_free(args.host, args.port)
    print(f"OpenAI-compatible frontend on http://{args.host}:{args.port}/v1 -> Triton "
          f"{', '.join(args.triton_url)}", file=sys.stderr, flush=True)
    try:
        web.run_app(build(), host=args.host, port=args.port, print=None,
                    handler_cancellation=True)
    except OSError as exc:  # taken between the check and the bind
        import errno

        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: "
                         f"{exc.strerror or exc}") from None
