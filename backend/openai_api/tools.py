"""Tool calling for `/v1/chat/completions`, as OpenAI's API and vLLM's frontend do it.

A request's `tools` (functions: a name, a description, a JSON schema of their parameters) go
to the chat template (its `tools` variable), which shows them to the model; `tool_choice`
says what the answer may hold:
- "none": text only (the tools are still shown, as vLLM does; nothing is parsed);
- "auto" (the default with tools): the model chooses; its text is read as Qwen's (Hermes)
  layout, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (what the chat
  template writes for an assistant's calls): the text before the first call is the message's
  content, each well-formed call of a known function a tool call (the first only with
  `parallel_tool_calls: false`), finish_reason "tool_calls"; a text whose calls do not parse
  is returned as it is, as content;
- "required": at least one call (one with `parallel_tool_calls: false`), and
  {"type": "function", "function": {"name": ...}}: a call of that function. Both are guided
  decoding (vLLM's way): the output is a JSON array of {"name", "parameters"} objects whose
  names are the tools' and whose parameters follow each tool's schema, or the named
  function's arguments as a JSON object of its schema, so the answer is always a call.
  Named calls end with finish_reason "stop", as OpenAI's; "required" with "tool_calls".

Streamed, a named call's arguments stream as they come (the first delta carries its id and
name); "auto" streams the content until the text reaches `<tool_call>` (a possible start of it
and the whitespace before it are held back) and sends each call whole when the choice ends;
"required" sends its calls when the choice ends.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backend.openai_api.errors import RequestError

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)", re.S)


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

    def stream(self) -> ToolStream | None:
        """A choice's reader of its text (None: "none", the text is all content)."""
        return None if self.choice == "none" else ToolStream(self)


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
        if choice not in (None, "none"):
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
    if not isinstance(name, str) or not NAME.match(name):
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


def hermes_calls(text: str, known: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]] | None:
    """`text` in Qwen's (Hermes) layout -> (the content before the first call, the calls as
    (name, arguments JSON)); None where it holds no call, or a call that is not a JSON object
    {"name": one of `known`, "arguments": an object} (then the text is all content)."""
    start = text.find(CALL_START)
    if start < 0:
        return None
    calls = []
    for match in _CALL.finditer(text, start):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in known:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(_call(call["name"], json.dumps(arguments, ensure_ascii=False)))
    return text[:start].rstrip(), calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolStream:
    """One choice's text read as the plan's tool calls while it streams: `feed` gives the
    content to send now and the tool-call deltas; `finish` the rest once the choice ended;
    `calls` holds the whole calls, `content` the whole content (None with calls and none)."""

    plan: ToolPlan
    held: str = ""
    content_parts: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _named: dict[str, Any] | None = None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.plan.choice == "function":  # the text is the arguments, as it comes
            if self._named is None:  # the first delta: the call's id and name
                self._named = _call(self.plan.name, text)
                self.calls.append(self._named)
                return "", [{"index": 0, **self._named,
                             "function": dict(self._named["function"])}]
            if not text:
                return "", []
            self._named["function"]["arguments"] += text
            return "", [{"index": 0, "function": {"arguments": text}}]
        self.held += text
        if self.plan.choice == "required" or CALL_START in self.held:
            return "", []
        # Held back: a possible start of the tag, and the whitespace before it (a call's
        # content is its text before the first call, trailing whitespace cut).
        cut = len(self.held) - tag_prefix_len(self.held, CALL_START)
        cut = len(self.held[:cut].rstrip())
        out, self.held = self.held[:cut], self.held[cut:]
        self.content_parts.append(out)
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The held text (what is content after all) and the calls' deltas, once."""
        if self.plan.choice == "function":
            return "", self.feed("")[1] if self._named is None else []
        held, self.held = self.held, ""
        if self.plan.choice == "required":
            self.calls = _array_calls(held, self.plan.schemas)
            rest = "" if self.calls else held
        else:
            found = hermes_calls(held, self.plan.schemas)
            rest, self.calls = (held, []) if found is None else found
            if not self.plan.parallel:  # one call at most: the first
                self.calls = self.calls[:1]
        self.content_parts.append(rest)
        return rest, [{"index": i, **c} for i, c in enumerate(self.calls)]

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return None if self.calls and not text else text

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason: "tool_calls" where "auto" / "required" called."""
        if self.calls and self.plan.choice in ("auto", "required") and reason == "stop":
            return "tool_calls"
        return reason


def _array_calls(text: str, known: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The guided "required" output (a JSON array of {"name", "parameters"}) -> calls; none
    where it does not parse (cut by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and i.get("name") in known and isinstance(i.get("parameters"),
                                                                          dict) for i in items):
        return []
    return [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def tag_prefix_len(text: str, tag: str) -> int:
    """The longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
