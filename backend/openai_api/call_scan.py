"""Tool calls read as the model writes them, so that their arguments stream piece by piece.

A call goes out (its id and name) as soon as its text shows which function it calls, then its
arguments as they come:
- Hermes JSON (Qwen's `<tool_call>` blocks, Nemotron's `<TOOLCALL>` arrays, the guided
  "required" array): once an object has begun `{"name": "<a known function>", "arguments": {`
  (or `"parameters"`), its arguments are re-written token by token by `JsonCanon` in
  `json.dumps`' layout; an object written another way (keys in another order, arguments as a
  JSON string) is read whole when its block closes;
- Qwen3-Coder's XML: once `<function=NAME>` names a known function, each `<parameter=KEY>`:
  a text-typed value character by character as it is written, any other as it closes (its
  conversion to its schema's type needs all of it).
The same readers read a whole text, so an answer is the same streamed or not. A call that has
begun stays a call: its arguments are what the model wrote even where they are cut short
(max_tokens) or are not valid JSON, as OpenAI's API says arguments may be.

Events: ("call", name) starts a call, ("args", text) continues the last one's arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

WS = " \t\r\n"
Event = tuple[str, str]
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_HEX = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_FUNCTION_HEAD = re.compile(r"<function=([^>\n]+)>")
_FUNCTION_END = "</function>"
_PARAMETER_HEAD = re.compile(r"<parameter=([^>\n]+)>")
_VALUE_ENDS = ("</parameter>", "<parameter=", _FUNCTION_END)
# Qwen3-Coder parameters read whole (a block that did not stream)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _char(ch: str) -> str:
    """One string character as json.dumps(ensure_ascii=False) writes it (a lone surrogate,
    which UTF-8 cannot carry, escaped)."""
    if ch >= " " and ch not in '"\\' and not "\ud800" <= ch <= "\udfff":
        return ch
    if "\ud800" <= ch <= "\udfff":
        return f"\\u{ord(ch):04x}"
    return json.dumps(ch, ensure_ascii=False)[1:-1]


def _scalar(token: str) -> str:
    """A number or literal as Python reads and writes it; as it is where it does not read as
    JSON or reads as no finite number (1e400: Python's inf, which json.dumps would write as
    `Infinity`, not JSON)."""
    try:
        return json.dumps(loads(token), allow_nan=False)
    except ValueError:
        return token


def _finite(text: str) -> float:
    number = float(text)
    if number - number != 0:  # inf (a number too large for a double)
        raise ValueError(f"{text} is out of the float range")
    return number


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """json.loads of strict JSON: no NaN / Infinity literals and no number out of the float
    range (Python would read them, and json.dumps write them back as text no JSON parser
    takes); ValueError for either."""
    return json.loads(text, parse_float=_finite, parse_constant=_constant)


def properties(schema: Any) -> dict[str, Any]:
    """A parameters schema's `properties` (empty where the schema or they are not objects)."""
    found = schema.get("properties") if isinstance(schema, dict) else None
    return found if isinstance(found, dict) else {}


def _hex(digits: str) -> int | None:
    return int(digits, 16) if _HEX.fullmatch(digits) else None


class JsonCanon:
    """One JSON value re-written as it streams in `json.dumps`' layout: ", " and ": " between
    items and no other whitespace, strings re-escaped as json.dumps(ensure_ascii=False) does,
    numbers and literals as Python reads and writes them. For valid JSON without repeated keys
    the text equals json.dumps(json.loads(text)); whatever the pieces, the same text. Lenient:
    what is not JSON passes as it is. `depth` 1 reads the rest of an object already open."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.quoted = False
        self.escape = ""  # an escape sequence being read (from its backslash)
        self.scalar = ""  # a number or literal being read
        self.done = False

    def feed(self, text: str) -> tuple[str, int | None]:
        """(the re-written text of `text`, where in it the value ended: None where not yet)."""
        if self.done:
            return "", 0
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.quoted:
                self._string(ch, out)
                if not self.quoted and self.depth == 0:
                    return self._end(out), i + 1
                continue
            if self.scalar:
                if ch not in WS and ch not in ',:[]{}"':
                    self.scalar += ch
                    continue
                out.append(self.finish())
                if self.depth == 0:
                    return self._end(out), i
            if ch in WS:
                continue
            if ch == '"':
                self.quoted = True
                out.append(ch)
            elif ch in "{[":
                self.depth += 1
                out.append(ch)
            elif ch in "}]":
                self.depth -= 1
                out.append(ch)
                if self.depth <= 0:
                    return self._end(out), i + 1
            elif ch == ",":
                out.append(", ")
            elif ch == ":":
                out.append(": ")
            else:
                self.scalar = ch
        return "".join(out), None

    def finish(self) -> str:
        """A number or literal the text ended in (its end was not seen)."""
        scalar, self.scalar = self.scalar, ""
        return _scalar(scalar) if scalar else ""

    def _end(self, out: list[str]) -> str:
        self.done = True
        return "".join(out)

    def _string(self, ch: str, out: list[str]) -> None:
        """One character inside a string; escapes are decoded once whole and re-escaped."""
        if not self.escape:
            if ch == "\\":
                self.escape = ch
            elif ch == '"':
                self.quoted = False
                out.append(ch)
            else:
                out.append(_char(ch))
            return
        self.escape += ch
        escape = self.escape
        if escape[1] != "u":
            self.escape = ""
            out.append(_char(_ESCAPES.get(ch, ch)))  # \" \\ \/ and the letters; \x: x
            return
        if len(escape) < 6:
            return
        high = _hex(escape[2:6])
        if high is None:  # not an escape after all: its characters as text
            self.escape = ""
            out.extend(_char(c) for c in escape)
            return
        if not 0xD800 <= high < 0xDC00:
            self.escape = ""
            out.append(_char(chr(high)))
            return
        # a high surrogate: the character is whole with the low one that should follow
        if (len(escape) == 7 and ch != "\\") or (len(escape) == 8 and ch != "u"):
            self.escape = ""
            out.append(_char(chr(high)))
            for c in escape[6:]:
                self._string(c, out)
            return
        if len(escape) < 12:
            return
        self.escape = ""
        low = _hex(escape[8:12])
        if low is not None and 0xDC00 <= low < 0xE000:
            out.append(chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)))
            return
        out.append(_char(chr(high)))
        for c in escape[6:]:
            self._string(c, out)


def tag_prefix_len(text: str, tag: str) -> int:
    """The longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _literal(rest: str, words: tuple[str, ...]) -> int | None:
    """The length of the word `rest` starts with; 0: it may still become one; None: not."""
    for word in words:
        if rest.startswith(word):
            return len(word)
    return 0 if any(word.startswith(rest) for word in words) else None


class JsonCall:
    """One `{"name": ..., "arguments": {...}}` object read as it streams: state "head" until
    its arguments' object opens ("reject": the name is not a known function; "whole": written
    another way, to be read whole), then "args" (re-written by JsonCanon), "tail" (the rest of
    the object), "done"."""

    HEAD = (("{",), ('"name"',), (":",), None, (",",), ("KEYS",), (":",), ("{",))

    def __init__(self, known: Mapping[str, Any], keys: tuple[str, ...]) -> None:
        self.known = known
        self.keys = tuple(f'"{k}"' for k in keys)
        self.text = ""
        self.pos = 0  # where the head's next token starts
        self.step = 0
        self.state = "head"
        self.name: str | None = None
        self.canon = JsonCanon()

    def feed(self, text: str) -> tuple[list[Event], int | None]:
        """(events, where in `text` the object ended: None where not yet)."""
        before = len(self.text)
        self.text += text
        events: list[Event] = []
        if self.state == "head":
            events += self._head()
        if self.state in ("args", "tail"):
            piece, end = self.canon.feed(self.text[self.pos:])
            if self.state == "args" and piece:
                events.append(("args", piece))
            if end is not None:
                self.pos += end
                if self.state == "args":
                    self.state, self.canon = "tail", JsonCanon(depth=1)
                    piece, end = self.canon.feed(self.text[self.pos:])
                    if end is not None:
                        self.pos += end
            if end is None:
                self.pos = len(self.text)
            elif self.canon.done:
                self.state = "done"
                return events, self.pos - before
        return events, None

    def close(self) -> list[Event] | None:
        """The arguments' last piece where the text ended; None where the head never ended
        (read whole)."""
        if self.state in ("head", "whole"):
            return None
        piece = self.canon.finish() if self.state == "args" else ""
        return [("args", piece)] if piece else []

    def _head(self) -> list[Event]:
        text = self.text
        while self.step < len(self.HEAD):
            while self.pos < len(text) and text[self.pos] in WS:
                self.pos += 1
            rest = text[self.pos:]
            if not rest:
                return []
            words = self.HEAD[self.step]
            if words is None:  # the name
                match = _STRING.match(rest)
                if rest[0] != '"':
                    self.state = "whole"
                    return []
                if match is None:
                    return []
                try:
                    name = json.loads(match.group())
                except ValueError:
                    self.state = "whole"
                    return []
                if name not in self.known:
                    self.state = "reject"
                    return []
                self.name, size = name, match.end()
            else:
                size = _literal(rest, self.keys if words == ("KEYS",) else words)
                if size is None:
                    self.state = "whole"
                    return []
                if size == 0:
                    return []
                if self.step == len(self.HEAD) - 1:  # the arguments' "{": the call begins
                    self.state = "args"
                    return [("call", self.name)]
            self.pos += size
            self.step += 1
        return []


class XmlCall:
    """Qwen3-Coder's `<function=NAME>` with `<parameter=KEY>value</parameter>`s read as it
    streams: the call once NAME is known, then each parameter: a text-typed one (`textual`
    of its schema: a string, or a schema that says nothing) character by character as it
    is written (the newline the template writes after the tag and before the end left out,
    as `value` does), any other as it closes, converted by `value(text, schema)`. A value
    ends at `</parameter>`, at the next `<parameter=` or at `</function>` (then, as at the
    end of the text, one more newline before it goes too)."""

    def __init__(self, known: Mapping[str, Any], value: Callable[[str, Any], Any],
                 textual: Callable[[Any], bool]) -> None:
        self.known, self.value, self.textual = known, value, textual
        self.name: str | None = None
        self.text = ""
        self.state = "head"
        self.pos = 0  # where reading goes on
        self.ended = False  # </function> seen
        self.sent = 0  # parameters begun
        self.key: str | None = None  # the parameter being read ...
        self.schema: Any = None  # ... its schema
        self.is_text = False  # ... whether its value is its text (streamed as it comes)
        self.streamed = 0  # characters of its value sent (text-typed ones)

    def feed(self, text: str) -> list[Event]:
        self.text += text
        if self.state == "head":
            rest = self.text.lstrip()
            match = _FUNCTION_HEAD.match(rest)
            if match is None:
                could = "<function=".startswith(rest) or (
                    rest.startswith("<function=") and "\n" not in rest and ">" not in rest)
                if not could:
                    self.state = "whole"
                return []
            name = match.group(1).strip()
            if name not in self.known:
                self.state = "reject"
                return []
            self.name, self.state = name, "args"
            self.pos = len(self.text) - len(rest) + match.end()
            return [("call", name)] + self._read(final=False)
        return self._read(final=False) if self.state == "args" else []

    def close(self) -> list[Event] | None:
        if self.state != "args":
            return None
        events = self._read(final=True)
        return events + [("args", "}" if self.sent else "{}")]

    def _schema(self, key: str) -> Any:
        return properties(self.known[self.name]).get(key)

    def _read(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while not self.ended:
            rest = self.text[self.pos:]
            if self.key is None:  # between parameters
                at, end = rest.find("<parameter="), rest.find(_FUNCTION_END)
                if end >= 0 and (at < 0 or end < at):
                    self.ended = True
                    break
                if at < 0:
                    break
                match = _PARAMETER_HEAD.match(rest, at)
                if match is None:
                    tail = rest[at + len("<parameter="):]
                    if "\n" in tail or ">" in tail:  # not a parameter tag: read past it
                        self.pos += at + 1
                        continue
                    break
                self.key, self.streamed = match.group(1).strip(), 0
                self.schema = self._schema(self.key)
                self.is_text = self.textual(self.schema)
                self.pos += match.end()
                if self.is_text:
                    events.append(("args", self._opening() + '"'))
                continue
            ends = [i for i in (rest.find("</parameter>"), rest.find("<parameter="),
                                rest.find(_FUNCTION_END)) if i >= 0]
            if ends:
                cut = min(ends)
                closed = rest.startswith("</parameter>", cut)
                events += self._finish(rest[:cut], last=not closed and
                                       rest.startswith(_FUNCTION_END, cut))
                self.pos += cut + (len("</parameter>") if closed else 0)
                continue
            if final:
                events += self._finish(rest, last=True)
                self.pos = len(self.text)
            elif self.is_text:
                held = max(tag_prefix_len(rest, tag) for tag in _VALUE_ENDS)
                events += self._stream(rest[:len(rest) - held].rstrip("\n"))
            break
        return events

    def _opening(self) -> str:
        """A parameter's start in the arguments: `{"key": ` or `, "key": `."""
        self.sent += 1
        return ("{" if self.sent == 1 else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "

    def _stream(self, text: str) -> list[Event]:
        """What of a text-typed value's text so far is sure to stay (not a newline that may
        be its last, nor what may become a tag), past what was sent."""
        return self._send(text[1:] if text.startswith("\n") else text)

    def _send(self, value: str) -> list[Event]:
        piece = "".join(_char(c) for c in value[self.streamed:])
        self.streamed = max(self.streamed, len(value))
        return [("args", piece)] if piece else []

    def _finish(self, text: str, last: bool) -> list[Event]:
        """A parameter's value read whole (`last`: ended by </function> or the text's end,
        where the pattern's `$` also leaves out a last newline)."""
        if last and text.endswith("\n"):
            text = text[:-1]
        schema = self.schema
        if self.is_text:
            events = self._send(self.value(text, schema)) + [("args", '"')]
        else:
            pair = self._opening() + json.dumps(self.value(text, schema), ensure_ascii=False)
            events = [("args", pair)]
        self.key = None
        return events


class CallArray:
    """A JSON array of call objects read as it streams (Nemotron's `<TOOLCALL>` blocks, the
    guided "required" output): each object as a JsonCall. Where the array is written another
    way it is read whole when it ends (`whole`: (item) -> (name, arguments) or None), past the
    calls already begun."""

    def __init__(self, known: Mapping[str, Any], keys: tuple[str, ...],
                 whole: Callable[[Any], tuple[str, str] | None]) -> None:
        self.known, self.keys, self.whole = known, keys, whole
        self.text = ""
        self.pos = 0
        self.state = "start"  # start ("["), open ("{" or "]"), after ("," or "]"), next ("{"),
        # item, end, whole, reject
        self.item: JsonCall | None = None
        self.begun = 0  # calls begun

    @property
    def rejected(self) -> bool:
        """Not calls, and nothing begun: the text is content."""
        return self.state == "reject" and not self.begun

    def feed(self, text: str) -> list[Event]:
        self.text += text
        events: list[Event] = []
        while self.pos < len(self.text):
            if self.state == "item":
                piece = self.text[self.pos:]
                more, end = self.item.feed(piece)
                events += more
                self.begun += sum(kind == "call" for kind, _ in more)
                if self.item.state in ("whole", "reject"):
                    self.state = self.item.state
                    break
                if end is None:
                    self.pos = len(self.text)
                    break
                self.pos += end
                self.state, self.item = "after", None
                continue
            if self.state not in ("start", "open", "after", "next"):
                break
            ch = self.text[self.pos]
            if ch in WS:
                self.pos += 1
                continue
            wanted = {"start": "[", "open": "{]", "after": ",]", "next": "{"}[self.state]
            if ch not in wanted:
                self.state = "whole"
                break
            if ch == "{":
                self.state, self.item = "item", JsonCall(self.known, self.keys)
                continue
            self.pos += 1
            self.state = {"[": "open", ",": "next", "]": "end"}[ch]
        return events

    def close(self) -> list[Event] | None:
        """The last events once the text ended; None where it holds no call (content)."""
        if self.state == "item":
            last = self.item.close()
            if last is not None:
                return last
        elif self.state in ("end", "after", "open", "next", "start") and self.begun:
            return []
        if self.state == "reject":
            return None if not self.begun else []
        try:
            items = loads(self.text)
        except ValueError:
            return None if not self.begun else []
        if not isinstance(items, list):
            return None if not self.begun else []
        events: list[Event] = []
        for item in items[self.begun:]:
            call = self.whole(item)
            if call is None:
                return None if not self.begun else events
            events += [("call", call[0]), ("args", call[1])]
        return events if events or self.begun else None


class CallBlock:
    """One `<tool_call>` block's body read as it streams: Hermes JSON (a JsonCall) or
    Qwen3-Coder XML (an XmlCall); written another way, read whole when it closes by
    `whole(body)` -> [(name, arguments)] (None or []: not a call)."""

    def __init__(self, known: Mapping[str, Any], value: Callable[[str, Any], Any],
                 textual: Callable[[Any], bool],
                 whole: Callable[[str], list[tuple[str, str]] | None]) -> None:
        self.known, self.value, self.textual, self.whole = known, value, textual, whole
        self.text = ""
        self.call: JsonCall | XmlCall | None = None
        self.state = "open"  # open, whole, reject (a function not known: no call)

    @property
    def rejected(self) -> bool:
        return self.state == "reject"

    def feed(self, text: str) -> list[Event]:
        self.text += text
        if self.state != "open":
            return []
        if self.call is None:
            rest = self.text.lstrip()
            if not rest:
                return []
            if rest[0] == "{":
                self.call = JsonCall(self.known, ("arguments", "parameters"))
            elif rest[0] == "<":
                self.call = XmlCall(self.known, self.value, self.textual)
            else:
                self.state = "whole"
                return []
            text = self.text
        if isinstance(self.call, JsonCall):
            events = self.call.feed(text)[0]
        else:
            events = self.call.feed(text)
        if self.call.state in ("whole", "reject"):
            self.state = self.call.state
        return events

    def close(self) -> list[Event] | None:
        """The block's last events; None where it is not a call."""
        if self.state == "reject":
            return None
        if self.state == "open" and self.call is not None:
            events = self.call.close()
            if events is not None:
                return events
        calls = self.whole(self.text.strip())
        if not calls:
            return None
        return [event for name, arguments in calls
                for event in (("call", name), ("args", arguments))]
