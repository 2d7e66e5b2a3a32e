"""Reasoning outputs for `/v1/chat/completions` (`--reasoning-parser qwen3`, as vLLM's): a
thinking model's `<think> ... </think>` goes to the message's `reasoning_content` (streamed as
`delta.reasoning_content`), the text after it to `content` (its leading newlines cut, as
Qwen3's template cuts them when the answer comes back in the history); tool calls are read
from the content only.

The reasoning starts where the output opens with `<think>`, or where the rendered prompt
already ends with it (templates that open the thinking block for the model: Qwen3.5's and
Qwen3-2507's thinking variants, DeepSeek-R1's); it ends at `</think>`. An output that never
opens it is all content (thinking switched off: `chat_template_kwargs.enable_thinking`); one
that opens it and is cut before `</think>` (max_tokens) is all reasoning. With tools (and the
qwen3 parser), a tool call's start tag also ends the reasoning, as vLLM's Qwen3 parser reads it:
a model that goes from thinking straight to a call without `</think>` still calls. While
streaming, a possible start of a tag is held back until the next text shows what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.openai_api.call_scan import tag_prefix_len

START = "<think>"
END = "</think>"
PARSERS = ("qwen3", "deepseek_r1")  # the same rule: the prompt says whether thinking is open


@dataclass
class ReasoningReader:
    """One choice's text split into (reasoning, content) as it streams."""

    thinking: bool  # inside the reasoning now
    opened: bool = False  # the start was read (or can no longer come)
    call_start: str | None = None  # a tool call's start tag: ends the reasoning too
    after_end: bool = False  # just past </think>: the answer's leading newlines go
    held: str = ""
    reasoning_parts: list[str] = field(default_factory=list)
    content_parts: list[str] = field(default_factory=list)

    @classmethod
    def for_prompt(cls, prompt: str, call_start: str | None = None) -> ReasoningReader:
        opened = prompt.rstrip().endswith(START)
        return cls(thinking=opened, opened=opened, call_start=call_start)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can go to the client now."""
        self.held += text
        reasoning = content = ""
        if not self.opened:
            head = self.held.lstrip()
            if head.startswith(START):
                self.held, self.thinking, self.opened = head[len(START):], True, True
            elif START.startswith(head):  # nothing yet, or a possible start of the tag
                return "", ""
            else:
                self.opened = True
        if self.thinking:
            end = self.held.find(END)
            call = self.held.find(self.call_start) if self.call_start else -1
            if 0 <= call and (end < 0 or call < end):  # a call ends the thinking: its text
                reasoning, self.held = self.held[:call], self.held[call:]  # is content
                self.reasoning_parts.append(reasoning)
                self.thinking = False
            elif end < 0:
                keep = tag_prefix_len(self.held, END)
                if self.call_start:
                    keep = max(keep, tag_prefix_len(self.held, self.call_start))
                cut = len(self.held) - keep
                reasoning, self.held = self.held[:cut], self.held[cut:]
                self.reasoning_parts.append(reasoning)
                return reasoning, ""
            else:
                reasoning, self.held = self.held[:end], self.held[end + len(END):]
                self.reasoning_parts.append(reasoning)
                self.thinking, self.after_end = False, True
        if self.after_end:
            self.held = self.held.lstrip("\n")
            if not self.held:
                return reasoning, ""
            self.after_end = False
        content, self.held = self.held, ""
        self.content_parts.append(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held, once the choice ended: reasoning where the block is still open."""
        held, self.held = self.held, ""
        if self.thinking:
            self.reasoning_parts.append(held)
            return held, ""
        if self.after_end:
            held = held.lstrip("\n")
        self.content_parts.append(held)
        return "", held

    @property
    def reasoning(self) -> str | None:
        return "".join(self.reasoning_parts) or None
