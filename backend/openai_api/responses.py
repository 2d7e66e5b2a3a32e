"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) on the
chat path: a request becomes a chat completion body (`to_chat`), runs as one, and its pieces
(reasoning, text, tool calls) become the response's output items, streamed as Responses events
or returned whole (one builder, `ResponseBuilder`, makes both, so they agree).

Accepted: `model`, `input` (a string, or a list of messages with `input_text` / `output_text`
parts, `function_call` and `function_call_output` items, `reasoning` items: the next
assistant message's `reasoning_content`), `instructions` (a system message first, not
carried to the next response), `previous_response_id` (the stored conversation, answer
included, goes first: the prefix cache serves it), `store` (default true: kept in memory, the
last STORE_SIZE responses), `max_output_tokens`, `temperature`, `top_p`, `tools` (function
tools, flat as the Responses API spells them), `tool_choice`, `parallel_tool_calls`,
`text.format` (`text`, `json_object`, `json_schema`), `stream`, `metadata` (echoed), and the
chat path's extra fields (`top_k`, `cache_salt`, `chat_template_kwargs`, ...). A response cut
by max_output_tokens is `incomplete` (`incomplete_details.reason`), and so is the output item it
cut. Refused with a 400: tools
other than functions, `background`, `conversation`, `prompt` (stored prompts), item
references, images and files, `truncation: "auto"`, `top_logprobs`, `max_tool_calls`.
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backend.openai_api import protocol
from backend.openai_api.errors import RequestError

STORE_SIZE = 1024  # responses kept for previous_response_id / GET (least recently used go)
# Responses fields that do not pass to the chat body as they are.
_OWN = {"input", "instructions", "previous_response_id", "store", "max_output_tokens", "text",
        "tools", "tool_choice", "stream", "metadata", "reasoning", "include", "truncation",
        "user", "n", "background", "conversation", "prompt", "prompt_cache_key",
        "safety_identifier", "service_tier", "top_logprobs", "max_tool_calls",
        "stream_options", "messages", "max_tokens", "max_completion_tokens",
        "response_format"}
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


@dataclass
class Stored:
    messages: list[dict[str, Any]]  # the conversation, answer included (chat messages)
    body: dict[str, Any]  # the response object


class ResponseStore:
    """The stored responses, least recently used first out (the event loop's only)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, rid: str) -> Stored | None:
        stored = self.items.get(rid)
        if stored is not None:
            self.items.move_to_end(rid)
        return stored

    def put(self, rid: str, stored: Stored) -> None:
        self.items[rid] = stored
        self.items.move_to_end(rid)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def delete(self, rid: str) -> bool:
        return self.items.pop(rid, None) is not None


@dataclass
class Conversion:
    """A Responses request as a chat completion body, and what its response echoes."""

    chat: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation without the instructions (stored)
    echo: dict[str, Any]  # the request's fields the response object repeats
    store: bool = True
    stream: bool = False
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")


# The chat fields a Responses request's own ones become (`to_chat`): an error of the chat path
# names the field the client sent.
_CHAT_NAMES = [(re.compile(r"\bresponse_format\.json_schema\."), "text.format."),
               (re.compile(r"\bresponse_format\b"), "text.format"),
               (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
               (re.compile(r"'messages'"), "'input'")]


def parse(body: Any, store: ResponseStore, names: Any, template: Any
          ) -> tuple[Conversion, protocol.Plan]:
    """A Responses request -> its chat body and the chat path's plan of it (`parse_chat`);
    errors name the Responses fields (max_output_tokens, text.format, input)."""
    conv = to_chat(body, store)
    try:
        return conv, protocol.parse_chat(conv.chat, names, template)
    except RequestError as exc:
        message, param = exc.message, exc.param
        for pattern, name in _CHAT_NAMES:
            message = pattern.sub(name, message)
            param = pattern.sub(name, param) if param else param
        raise RequestError(message, param, exc.status, exc.kind, exc.code) from None


def to_chat(body: Any, store: ResponseStore) -> Conversion:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name, why in (("background", "background responses"), ("conversation", "conversations"),
                      ("prompt", "stored prompts")):
        if body.get(name) not in (None, False, {}, ""):
            raise RequestError(f"'{name}' ({why}) is not supported", name)
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError("'truncation' must be 'disabled': an input longer than the context "
                           "is refused, not cut", "truncation")
    for name in ("top_logprobs", "prompt_logprobs", "max_tool_calls"):
        if body.get(name) is not None:
            raise RequestError(f"'{name}' is not supported by /v1/responses (chat "
                               "completions return log probabilities)", name)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise RequestError(f"'previous_response_id' must be a string, got {previous!r:.40}",
                               "previous_response_id")
        stored = store.get(previous)
        if stored is None:
            raise RequestError(f"previous response {previous!r} not found (responses are "
                               f"kept in memory, the last {store.size})",
                               "previous_response_id", 404, code="not_found")
        history = copy.deepcopy(stored.messages)
    history += input_messages(body.get("input"))
    chat = {k: v for k, v in body.items() if k not in _OWN}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string", "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) \
        + history
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools not in (None, []):
        chat["tools"] = _chat_tools(tools)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None and not (choice == "auto" and "tools" not in chat):
        chat["tool_choice"] = choice  # ("auto", the Responses default, holds without tools)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise RequestError(f"'text' must be an object (text.format: the output's format), got "
                           f"{text!r:.40}", "text")
    fmt = _text_format(text)
    if fmt is not None:
        chat["response_format"] = fmt
    stream, keep = body.get("stream", False), body.get("store", True)
    for name, value in (("stream", stream), ("store", keep)):
        if not isinstance(value, bool):
            raise RequestError(f"'{name}' must be true or false, got {value!r}", name)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("'metadata' must be an object", "metadata")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata or {}, "parallel_tool_calls": body.get("parallel_tool_calls",
                                                                         True),
            "previous_response_id": previous, "temperature": body.get("temperature"),
            "tool_choice": body.get("tool_choice", "auto" if tools else "none"),
            "tools": tools or [], "top_p": body.get("top_p"), "store": keep,
            "text": {"format": fmt_echo(body.get("text"))}, "truncation": "disabled"}
    return Conversion(chat, history, echo, keep, stream)


def fmt_echo(text: Any) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    return fmt if isinstance(fmt, dict) else {"type": "text"}


def input_messages(items: Any) -> list[dict[str, Any]]:
    """`input` -> chat messages: a function_call joins the assistant message before it (or
    starts one), a function_call_output is a tool message, a reasoning item's text is the
    next assistant message's `reasoning_content` (Qwen3's templates show it in a tool-calling
    turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's, for the next assistant message

    def assistant(message: dict[str, Any]) -> None:
        nonlocal thought
        if thought is not None:
            message["reasoning_content"], thought = thought, None
        out.append(message)

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role must be user, system, developer or "
                                   f"assistant, got {role!r}", "input")
            message = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant":
                assistant(message)
            else:
                out.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and thought is None:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                assistant({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = _text(parts, where) if parts else None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": output if isinstance(output, str)
                        else _text(output, where, "output")})
        else:
            raise RequestError(f"{where}: items of type {kind!r} are not supported (messages, "
                               "function_call, function_call_output, reasoning)", "input")
    if not out:
        raise RequestError("'input' holds no message", "input")
    return out


def _text(content: Any, where: str, field: str = "content") -> str:
    """A message's text: a string, or a list of text parts (`where.field` in errors)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.{field}[{j}]: only text parts are supported, got "
                                   f"{kind!r}", "input")
            texts.append(part["text"])
        return "\n".join(texts)  # as a chat message's parts (`protocol.parse_chat`)
    raise RequestError(f"{where}.{field} must be a string or a list of text parts", "input")


def _string(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{name} must be a string", "input")
    return value


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools -> chat's {"type": "function", "function": {...}}."""
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported, got {kind!r}",
                               "tools")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}})
    return out


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt.get("schema")}}
    raise RequestError("text.format.type must be 'text', 'json_object' or 'json_schema', got "
                       f"{kind!r}", "text")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response object and its stream events, built from the chat run's pieces: `start`
    (created, in_progress), `feed` a piece (reasoning, text, tool-call deltas), `finish`
    (items closed, usage, completed / incomplete). `body` is the response at every point."""

    def __init__(self, conv: Conversion, model: str) -> None:
        self.body = {"id": conv.id, "object": "response", "created_at": int(time.time()),
                     "status": "in_progress", "error": None, "incomplete_details": None,
                     "model": model, "output": [], "usage": None, **conv.echo}
        self.sequence = 0
        self.open: int | None = None  # the reasoning or message item text goes to
        self.calls: dict[int, int] = {}  # a tool call's index -> its output item

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=copy.deepcopy(self.body)),
                self._event("response.in_progress", response=copy.deepcopy(self.body))]

    def feed(self, reasoning: str, text: str, calls: list[dict[str, Any]]) -> list[dict]:
        events: list[dict[str, Any]] = []
        if reasoning:
            events += self._text("reasoning", reasoning)
        if text:
            events += self._text("message", text)
        for delta in calls:
            if "id" in delta:  # a new call
                events += self._close()
                item = {"type": "function_call", "id": _item_id("fc"), "call_id": delta["id"],
                        "name": delta["function"]["name"], "arguments": "",
                        "status": "in_progress"}
                self.calls[delta["index"]] = len(self.body["output"])
                self.body["output"].append(item)
                events.append(self._event("response.output_item.added",
                                          output_index=self.calls[delta["index"]],
                                          item=copy.deepcopy(item)))
            index = self.calls[delta["index"]]
            item = self.body["output"][index]
            part = delta["function"].get("arguments") or ""
            if part:
                item["arguments"] += part
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=item["id"], output_index=index, delta=part))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = self._open(kind)
        item = self.body["output"][self.open]
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else \
            "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=item["id"], output_index=self.open,
                                  content_index=0, delta=text, **extra))
        return events

    def _open(self, kind: str) -> list[dict[str, Any]]:
        """A reasoning or message item for text, unless it is the open one."""
        events: list[dict[str, Any]] = []
        output = self.body["output"]
        if self.open is None or output[self.open]["type"] != kind:
            events += self._close()
            if kind == "message":
                item = {"type": "message", "id": _item_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}
            else:
                item = {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                        "content": [], "status": "in_progress"}
            self.open = len(output)
            output.append(item)
            events.append(self._event("response.output_item.added", output_index=self.open,
                                      item=copy.deepcopy(item)))
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    if kind == "message" else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            if kind == "message":
                events.append(self._event("response.content_part.added", item_id=item["id"],
                                          output_index=self.open, content_index=0,
                                          part=copy.deepcopy(part)))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The open reasoning or message item, done (`status` "incomplete": cut short)."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.body["output"][index]
        part = item["content"][0]
        item["status"] = status
        if item["type"] == "message":
            events = [self._event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0,
                                  part=copy.deepcopy(part))]
        else:
            events = [self._event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"])]
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=copy.deepcopy(item))]

    def finish(self, reason: str, usage: Mapping[str, Any],
               reasoning_tokens: int = 0) -> list[dict[str, Any]]:
        """Every item closed (an answer with no item gets an empty message), the usage, and
        the status: "incomplete" where max_output_tokens cut it (the item it cut too)."""
        cut = "incomplete" if reason == "length" else "completed"
        events = [] if self.body["output"] else self._open("message")
        events += self._close(cut)
        last = len(self.body["output"]) - 1
        for index in self.calls.values():
            item = self.body["output"][index]
            item["status"] = cut if index == last else "completed"
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=copy.deepcopy(item)))
        self.body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"]}
        if reason == "length":
            self.body["status"] = "incomplete"
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
            kind = "response.incomplete"
        else:
            self.body["status"] = "completed"
            kind = "response.completed"
        return events + [self._event(kind, response=copy.deepcopy(self.body))]

    def answer(self) -> dict[str, Any]:
        """The answer as a chat message (what the next response's history holds). A function
        call whose arguments are no JSON object (max_output_tokens cut it: "incomplete", or
        the model wrote them so) is left out of it, so that a follow-up through
        previous_response_id still renders (chat templates take arguments as objects)."""
        text = "".join(i["content"][0]["text"] for i in self.body["output"]
                       if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"] or "{}"}}
                 for i in self.body["output"]
                 if i["type"] == "function_call" and i.get("status") != "incomplete"
                 and _json_object(i["arguments"] or "{}")]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        thought = "".join(i["content"][0]["text"] for i in self.body["output"]
                          if i["type"] == "reasoning")
        if thought:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
        return message


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
