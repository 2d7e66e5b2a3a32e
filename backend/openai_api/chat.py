"""The model's chat template: tokenizer_config.json's `chat_template` (Jinja) rendered in a
sandbox with the variables transformers' `apply_chat_template` passes (`messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`; a
request's `chat_template_kwargs`, such as Qwen3's `enable_thinking`, on top), and the special
tokens that end an assistant turn, which a chat request stops at.

The turn end is found by rendering a probe conversation and reading what the template writes
right after the assistant's text (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3); it counts
when it is one of the tokenizer's special tokens. The model's end ids (generation_config.json's
`eos_token_id`, one or a list) count too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError as JinjaError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backend.tokenizer import token_text

_PROBE_USER = "\u2063probe-user\u2063"
_PROBE_ASSISTANT = "\u2063probe-assistant\u2063"


class TemplateError(ValueError):
    """The template raised (`raise_exception`) or could not render these messages."""


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, template: str, special_tokens: Mapping[str, int],
                 bos_token: str | None = None, eos_token: str | None = None,
                 end_ids: Sequence[int] = ()) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        # transformers' tojson: no HTML escaping, unicode kept.
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent)
        try:
            self._template = env.from_string(template)
        except JinjaError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        by_id = {i: t for t, i in special_tokens.items()}
        stops = [by_id[i] for i in end_ids if i in by_id]
        turn_end = self._turn_end(set(special_tokens))
        if turn_end is not None:
            stops.insert(0, turn_end)
        self.stop_words: list[str] = list(dict.fromkeys(stops))

    @classmethod
    def from_dir(cls, directory: str | Path,
                 special_tokens: Mapping[str, int]) -> ChatTemplate | None:
        """The template of a model / tokenizer folder (None: it has none)."""
        directory = Path(directory)
        config = _read_json(directory / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            jinja = directory / "chat_template.jinja"
            template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
        if template is None:
            return None
        end = _read_json(directory / "generation_config.json").get("eos_token_id")
        end_ids = [end] if isinstance(end, int) else [i for i in end or [] if isinstance(i, int)]
        return cls(template, special_tokens, token_text(config.get("bos_token")),
                   token_text(config.get("eos_token")), end_ids)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None,
               continue_final_message: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text; `tools`: the template's `tools` (function tools, as OpenAI sends
        them); `extra`: more template variables (a request's chat_template_kwargs), which
        cannot replace the ones above. `continue_final_message` (transformers' and vLLM's):
        the text ends with the last message's content, open (its turn end and what follows
        cut), so the model continues that message."""
        variables = {**(extra or {}), "messages": list(messages),
                     "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token,
                     "tools": list(tools) if tools else None}
        try:
            text = self._template.render(**variables)
        except TemplateError:
            raise
        except (JinjaError, TypeError, KeyError, ValueError) as exc:
            raise TemplateError(f"the chat template cannot render these messages: {exc}") from exc
        if continue_final_message:
            content = str(messages[-1].get("content") or "")
            stripped = content.strip()
            where = text.rfind(stripped) if stripped else -1
            if where < 0:
                raise TemplateError("continue_final_message: the last message's content does "
                                    "not appear in the rendered chat")
            kept = content.lstrip()  # its trailing whitespace too, where the template kept it
            end = where + (len(kept) if text.startswith(kept, where) else len(stripped))
            text = text[:end]
        return text

    def _turn_end(self, specials: set[str]) -> str | None:
        try:
            text = self.render([{"role": "user", "content": _PROBE_USER},
                                {"role": "assistant", "content": _PROBE_ASSISTANT}],
                               add_generation_prompt=False)
        except ValueError:
            return None
        _, found, after = text.partition(_PROBE_ASSISTANT)
        if not found:
            return None
        head = after.strip().split(maxsplit=1)
        if not head:
            return None
        # The longest special token the text after the assistant's reply starts with.
        matches = [s for s in specials if head[0].startswith(s)]
        return max(matches, key=len) if matches else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    return value if isinstance(value, dict) else {}
