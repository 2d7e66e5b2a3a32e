"""Tool calling for `/v1/chat/completions`, as OpenAI's API and vLLM's frontend do it.

A request's `tools` (functions: a name, a description, a JSON schema of their parameters) go
to the chat template (its `tools` variable), which shows them to the model; `tool_choice`
says what the answer may hold:
- "none": text only (the tools are still shown, as vLLM does; nothing is parsed);
- "auto" (the default with tools): the model chooses; its text is read in the layout the
  server's `--tool-call-parser` names (LAYOUTS): "qwen" (the default), Qwen's `<tool_call>`
  blocks holding either Hermes JSON, `{"name": ..., "arguments": {...}}` (Qwen2.5 / Qwen3 /
  Qwen3-Next and the tiny models' template), or Qwen3-Coder's XML, `<function=NAME>` with one
  `<parameter=KEY>value</parameter>` per argument (Qwen3.5, Qwen3-Coder, Nemotron 3: each
  value converted to its schema's type); "nemotron", `<TOOLCALL>[{"name", "arguments"},
  ...]</TOOLCALL>` (Nemotron Nano 2). The text before the first call is the message's
  content, each call of a known function a tool call (the first only with
  `parallel_tool_calls: false`), finish_reason "tool_calls". A text whose first block is not
  such a call is returned as it is, as content; a later block that is not one is dropped
  (its calls before it may have been streamed already); a call that has begun stays one
  (its arguments as written, also where max_tokens cut them);
- "required": at least one call (one with `parallel_tool_calls: false`), and
  {"type": "function", "function": {"name": ...}}: a call of that function. Both are guided
  decoding (vLLM's way): the output is a JSON array of {"name", "parameters"} objects whose
  names are the tools' and whose parameters follow each tool's schema, or the named
  function's arguments as a JSON object of its schema, so the answer is always a call.
  Named calls end with finish_reason "stop", as OpenAI's; "required" with "tool_calls".

Streamed, a named call's arguments stream as they come (the first delta carries its id and
name); "auto" streams the content until the text reaches the layout's start tag (a possible
start of it and the whitespace before it are held back), then each call once its function is
known and its arguments piece by piece (`call_scan`); "required" the same for each object in
the array. Streamed or not, the answer is the same: the whole text is read by the same
reader (`CallReader`, `ArrayReader`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backend.openai_api.call_scan import (
    PARAMETER,
    CallArray,
    CallBlock,
    Event,
    loads,
    properties,
    tag_prefix_len,
)
from backend.openai_api.errors import RequestError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch)
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Layout:
    """How a model's template writes tool calls: blocks between `start` and `end` (the last
    block may lack its end: the model stopped after it), each holding one call (Qwen) or a
    JSON array of calls (`array`: Nemotron's)."""

    start: str
    end: str
    array: bool = False


QWEN = Layout("<tool_call>", "</tool_call>")
NEMOTRON = Layout("<TOOLCALL>", "</TOOLCALL>", array=True)
LAYOUTS = {"qwen": QWEN, "nemotron": NEMOTRON,
           # vLLM's names for the same layouts
           "hermes": QWEN, "qwen3_coder": QWEN, "qwen3_xml": QWEN, "nemotron_json": NEMOTRON}
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)


@dataclass
class ToolPlan:
    """A chat request's tools and what its answer may hold."""

    tools: list[dict[str, Any]]  # as the template gets them: {"type": "function", "function"}
    choice: str  # "none" | "auto" | "required" | "function" (the one `name` names)
    name: str | None = None
    parallel: bool = True

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                for t in self.tools}

    def guide(self) -> tuple[str, str] | None:
        """(guide type, guide) for "required" and a named function; None otherwise."""
        schemas = self.schemas
        if self.choice == "function":
            return "json_schema", json.dumps(schemas[self.name])
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                   "parameters": s},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n, s in schemas.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return "json_schema", json.dumps(array)

    def stream(self, layout: Layout = QWEN) -> ToolStream | None:
        """A choice's reader of its text, in the calls' `layout` (None: "none", the text is
        all content)."""
        return None if self.choice == "none" else ToolStream(self, layout)


def parse_tools(body: Mapping[str, Any]) -> ToolPlan | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` -> a ToolPlan (None: no tools);
    OpenAI's legacy `functions` / `function_call` get a 400 that points to `tools`."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) not in (None, [], {}):
            raise RequestError(f"'{legacy}' (deprecated by OpenAI) is not supported: use "
                               "'tools' and 'tool_choice'", legacy)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise RequestError(f"'parallel_tool_calls' must be true or false, got {parallel!r}",
                           "parallel_tool_calls")
    if tools in (None, []):
        # "auto" and "required" over an empty list read as "none", as vLLM does it
        if choice not in (None, "none") and not (tools == [] and choice in CHOICES):
            raise RequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of tools", "tools")
    specs: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        specs.append(_tool(tool, f"tools[{i}]"))
    names = [t["function"]["name"] for t in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RequestError(f"tools: the function name {twice[0]!r} is given more than once",
                           "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise RequestError(f"'tool_choice' must be one of {list(CHOICES)} or "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                               f"got {choice!r}", "tool_choice")
        return ToolPlan(specs, choice, parallel=parallel)
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise RequestError("'tool_choice' must be a string or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", "tool_choice")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError("tool_choice.function.name must be a string", "tool_choice")
    if name not in names:
        raise RequestError(f"tool_choice names the function {name!r}, which is not one of "
                           f"the tools {names}", "tool_choice")
    return ToolPlan(specs, "function", name, parallel)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RequestError(f"{where} must be {{\"type\": \"function\", \"function\": "
                           "{...}} (only function tools are supported)", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"{where}.function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', "
                           f"got {name!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"{where}.function.parameters must be a JSON schema object",
                           "tools")
    spec = {k: v for k, v in function.items() if v is not None}
    return {"type": "function", "function": spec}


def message_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as chat templates take them: arguments as an
    object (OpenAI sends them as a JSON string)."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{at} must be {{\"type\": \"function\", \"function\": "
                               "{\"name\", \"arguments\"}}", where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise RequestError(f"{at}.function.arguments is not valid JSON", where) \
                    from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{at}.function.arguments must be a JSON object", where)
        entry = {"type": "function", "function": {"name": function["name"],
                                                  "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_calls(text: str, known: Mapping[str, Any], layout: Layout = QWEN,
               ) -> tuple[str, list[dict[str, Any]]] | None:
    """`text` in `layout` -> (the content before the first call, the calls as (name,
    arguments JSON)); None where it holds no call, or its first block is not a call of one of
    the `known` functions (name -> parameters schema) (then the text is all content)."""
    reader = CallReader(known, layout)
    content, events = reader.feed(text)
    rest, more = reader.finish()
    calls = whole_calls(events + more)
    return (content + rest, calls) if calls else None


def whole_calls(events: list[Event]) -> list[dict[str, Any]]:
    """Readers' events -> the calls they make."""
    calls: list[dict[str, Any]] = []
    for kind, value in events:
        if kind == "call":
            calls.append(_call(value, ""))
        else:
            calls[-1]["function"]["arguments"] += value
    return calls


@dataclass
class CallReader:
    """Text in a layout read as it streams: content until the first block's start tag (a
    possible start of the tag and the whitespace before it held back), then each block's
    calls as they come (`call_scan`: a call once its function is known, then its arguments
    piece by piece). Where the first block is not a call the whole text is content; a later
    such block is dropped, and so is text between blocks."""

    known: Mapping[str, Any]  # function name -> its parameters' schema
    layout: Layout = QWEN
    mode: str = "content"  # "content" (no tag yet), "calls", or "text" (all content after all)
    held: str = ""
    gap: str = ""  # the whitespace before the first tag
    raw: str = ""  # the text from the first tag on
    block: CallBlock | CallArray | None = None  # the open block
    begun: int = 0  # calls begun
    quotes: Quotes | None = None  # the open block's JSON strings (its end tag may be quoted)

    def feed(self, text: str) -> tuple[str, list[Event]]:
        """(content that can go now, events read now)."""
        if self.mode == "text":
            return text, []
        self.held += text
        out = ""
        start, end_tag = self.layout.start, self.layout.end
        if self.mode == "content":
            at = self.held.find(start)
            if at < 0:
                cut = len(self.held) - tag_prefix_len(self.held, start)
                cut = len(self.held[:cut].rstrip())
                out, self.held = self.held[:cut], self.held[cut:]
                return out, []
            out = self.held[:at].rstrip()
            self.gap, self.held = self.held[len(out):at], self.held[at:]
            self.raw, self.mode = self.held, "calls"
        else:
            self.raw += text
        events: list[Event] = []
        while True:
            if self.block is None:
                at = self.held.find(start)
                if at < 0:  # text between blocks: dropped
                    self.held = self.held[len(self.held) - tag_prefix_len(self.held, start):]
                    return out, events
                self.held = self.held[at + len(start):]
                self.block, self.quotes = self._new_block(), Quotes()
            end = self.quotes.find(self.held, end_tag)
            body = self.held[:end] if end >= 0 else \
                self.held[:len(self.held) - tag_prefix_len(self.held, end_tag)]
            self.quotes.feed(body)
            self.held = self.held[len(body):]
            events += self._count(self.block.feed(body))
            if self.block.rejected and not self.begun:
                return out + self._all_text(), []
            if end < 0:
                return out, events
            self.held = self.held[len(end_tag):]
            done, self.block = self.block.close(), None
            if done is None and not self.begun:
                return out + self._all_text(), []
            events += self._count(done or [])

    def finish(self) -> tuple[str, list[Event]]:
        """What was held: content where no call came (or the first block was not one), or
        the last events of a block that lacks its end tag."""
        held, self.held = self.held, ""
        if self.mode == "content":
            return held, []
        if self.block is None:
            return "", []
        events = self._count(self.block.feed(held))
        done, self.block = self.block.close(), None
        if done is None and not self.begun:
            return self._all_text(), []
        return "", events + self._count(done or [])

    def _new_block(self) -> CallBlock | CallArray:
        if self.layout.array:
            return CallArray(self.known, ("arguments", "parameters"), self._item)
        return CallBlock(self.known, _xml_value, _textual, self._whole)

    def _whole(self, body: str) -> list[tuple[str, str]] | None:
        """A Qwen block written in neither streamed form, read whole."""
        if body.startswith("<function="):  # Qwen3-Coder's XML
            match = _FUNCTION.fullmatch(body)
            if match is None or match.group(1).strip() not in self.known:
                return None
            name = match.group(1).strip()
            schemas = properties(self.known[name])
            arguments = {key.strip(): _xml_value(value, schemas.get(key.strip()))
                         for key, value in PARAMETER.findall(match.group(2))}
            return [(name, json.dumps(arguments, ensure_ascii=False))]
        try:
            found = loads(body)
        except ValueError:
            return None
        call = self._item(found)
        return None if call is None else [call]

    def _item(self, call: Any) -> tuple[str, str] | None:
        """A call object read whole: {"name", "arguments" (or "parameters")}; the arguments
        an object, or a JSON string of one (some models write them so)."""
        if not isinstance(call, dict) or call.get("name") not in self.known:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)

    def _count(self, events: list[Event]) -> list[Event]:
        self.begun += sum(kind == "call" for kind, _ in events)
        return events

    def _all_text(self) -> str:
        self.mode, self.held, self.block = "text", "", None
        return self.gap + self.raw


@dataclass
class Quotes:
    """Where a call block's text is inside a JSON string, so that an end tag written in a
    string argument ("... ends calls with </tool_call> ...") does not close the block. Only
    for a block whose text starts as JSON ("{" or "["); an XML block (Qwen3-Coder's) has no
    JSON strings and ends at its first end tag."""

    json: bool | None = None  # undecided until the block's first non-space character
    quoted: bool = False
    escaped: bool = False

    def feed(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def find(self, text: str, tag: str) -> int:
        """The first `tag` in `text` (which follows what was fed) outside a JSON string; -1
        where there is none yet."""
        at = text.find(tag)
        if at < 0 or self.json is False:
            return at
        probe = Quotes(self.json, self.quoted, self.escaped)
        done = 0
        while at >= 0:
            probe.feed(text[done:at])
            if not probe.quoted:
                return at
            done = at
            at = text.find(tag, at + 1)
        return -1

    def _step(self, ch: str) -> None:
        if self.json is None:
            if ch.isspace():
                return
            self.json = ch in "{["
        if not self.json:
            return
        if self.escaped:
            self.escaped = False
        elif self.quoted and ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.quoted = not self.quoted


def _xml_value(text: str, schema: Any) -> Any:
    """One `<parameter=KEY>` value (the template writes it between newlines) as its schema's
    type says; text where the schema says string, says nothing, or the text does not convert."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    kinds = _types(schema)
    word = text.strip()
    if _textual(schema):
        return text
    if word.lower() == "null":
        return None
    for kind in ("integer", "number", "boolean", "object", "array"):
        if kind not in kinds:
            continue
        try:
            if kind == "integer":
                return int(word)
            if kind == "number":
                number = float(word)
                if number - number != 0:
                    continue  # nan, inf, 1e400: no JSON number
                return int(number) if number.is_integer() and "." not in word \
                    and "e" not in word.lower() else number
            if kind == "boolean":
                if word.lower() in ("true", "false"):
                    return word.lower() == "true"
                continue
            value = loads(word)
            if isinstance(value, dict if kind == "object" else list):
                return value
        except ValueError:
            continue
    return text


def _textual(schema: Any) -> bool:
    """Whether `_xml_value` keeps a value of this schema as its text."""
    kinds = _types(schema)
    return "string" in kinds or kinds == {None}


def _types(schema: Any) -> set[str | None]:
    """The JSON types a schema admits: its `type` (one or a list), its `anyOf` / `oneOf`
    members' (nullable unions included), the types of its `enum` / `const` values; {None}
    where it says none of these (any value)."""
    if not isinstance(schema, dict):
        return {None}
    kind = schema.get("type")
    if kind is not None:  # (a malformed one, not a name or a list of names: any value)
        kinds = kind if isinstance(kind, list) else [kind]
        return {k for k in kinds if isinstance(k, str)} or {None}
    members = [m for key in ("anyOf", "oneOf")
               for m in (schema.get(key) if isinstance(schema.get(key), list) else [])]
    if members:
        kinds = set().union(*(_types(m) for m in members))
        return {None} if None in kinds else kinds
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        names = {bool: "boolean", int: "integer", float: "number", str: "string",
                 type(None): "null", dict: "object", list: "array"}
        return {names[type(v)] for v in values if type(v) in names} or {None}
    return {None}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolStream:
    """One choice's text read as the plan's tool calls while it streams: `feed` gives the
    content to send now and the tool-call deltas (a call's first carries its id and name,
    the next ones pieces of its arguments); `finish` the rest once the choice ended; `calls`
    holds the whole calls, `content` the whole content (None with calls and none)."""

    plan: ToolPlan
    layout: Layout = QWEN
    content_parts: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _named: dict[str, Any] | None = None
    _reader: CallReader | ArrayReader | None = None
    _skip: bool = False  # the calls after the first without parallel calls

    def __post_init__(self) -> None:
        if self.plan.choice == "auto":
            self._reader = CallReader(self.plan.schemas, self.layout)
        elif self.plan.choice == "required":
            self._reader = ArrayReader(self.plan.schemas)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._reader is None:  # a named function: the text is the arguments, as it comes
            if self._named is None:  # the first delta: the call's id and name
                self._named = _call(self.plan.name, text)
                self.calls.append(self._named)
                return "", [{"index": 0, **self._named,
                             "function": dict(self._named["function"])}]
            if not text:
                return "", []
            self._named["function"]["arguments"] += text
            return "", [{"index": 0, "function": {"arguments": text}}]
        return self._passed(*self._reader.feed(text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The held text (what is content after all) and the last calls' deltas, once."""
        if self._reader is None:
            return "", self.feed("")[1] if self._named is None else []
        return self._passed(*self._reader.finish())

    def _passed(self, content: str, events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
        """The content and the events as deltas (numbered; one call at most without parallel
        calls: the first); a call's pieces read at once go in one delta."""
        self.content_parts.append(content)
        deltas: list[dict[str, Any]] = []
        for kind, value in events:
            if kind == "call":
                self._skip = bool(self.calls) and not self.plan.parallel
                if self._skip:
                    continue
                call = _call(value, "")
                self.calls.append(call)
                deltas.append({"index": len(self.calls) - 1, **call,
                               "function": dict(call["function"])})
            elif not self._skip:
                self.calls[-1]["function"]["arguments"] += value
                if deltas and deltas[-1]["index"] == len(self.calls) - 1:
                    deltas[-1]["function"]["arguments"] += value
                else:
                    deltas.append({"index": len(self.calls) - 1,
                                   "function": {"arguments": value}})
        return content, deltas

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return None if self.calls and not text else text

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason: "tool_calls" where "auto" / "required" called."""
        if self.calls and self.plan.choice in ("auto", "required") and reason == "stop":
            return "tool_calls"
        return reason


class ArrayReader:
    """The guided "required" output, a JSON array of {"name", "parameters"}, read as it
    streams (`CallArray`): each call as its object begins, then its arguments piece by piece.
    The text is content only where no call began (cut by max_tokens before one did)."""

    def __init__(self, known: Mapping[str, Any]) -> None:
        self.known = known
        self.array = CallArray(known, ("parameters",), self._item)

    def feed(self, text: str) -> tuple[str, list[Event]]:
        return "", self.array.feed(text)

    def finish(self) -> tuple[str, list[Event]]:
        events = self.array.close()
        return (self.array.text, []) if events is None else ("", events)

    def _item(self, item: Any) -> tuple[str, str] | None:
        if not isinstance(item, dict) or item.get("name") not in self.known or \
                not isinstance(item.get("parameters"), dict):
            return None
        return item["name"], json.dumps(item["parameters"], ensure_ascii=False)


