"""OpenAI request bodies -> ensemble inputs; stop strings; finish reasons; response bodies.

Accepted (`/v1/completions` and `/v1/chat/completions`, as OpenAI's API and vLLM's frontend):
`model`, `max_tokens` (chat: also `max_completion_tokens`; default 16 for completions, for chat
up to the context limit), `temperature`, `top_p`, `n` (-> num_return_sequences), `seed`,
`presence_penalty`, `frequency_penalty`, `logit_bias` (token id -> -100..100, added to the
logits: the ensemble's `embedding_bias_token_ids` / `_weights`), `stop` (a string or a list:
generation ends where the text first holds one, which is not returned), `stream`,
`stream_options.include_usage` (and vLLM's `continuous_usage_stats`: the usage so far on every
chunk),
`response_format` (`text`, `json_object`, `json_schema`: guided decoding), completions' `echo`
(the prompt before the text), a list of prompts and prompts as token ids (one list or a list of
lists: sent as their text, which must encode back to the same ids), `logprobs` (completions:
how many alternatives, 0..20; chat: true, with `top_logprobs` 0..20): the model's log
probability of each returned token and of the likeliest tokens at its position (the raw
distribution, whatever sampled the token), in OpenAI's two layouts, with `echo` the prompt's
tokens too (the first one has none); vLLM's extra fields `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `allowed_token_ids` (only these tokens are
generated; not with a guide), `skip_special_tokens` (false: special tokens are written in the
text, but not a special stop token that ended it, as vLLM's), `stop_token_ids` (generation
ends on one of these tokens, which stays in the text; a choice that ended names the stop
string or token in
its `stop_reason`, as vLLM's), `include_stop_str_in_output`, `bad_words`,
`guided_json`, `guided_regex`, `guided_grammar`, `guided_choice` (exactly one of the
strings; or vLLM's newer `structured_outputs` object: `json`, `regex`, `grammar`, `choice`,
`json_object`, `structural_tag`), `use_beam_search` (the n choices are a beam search's n
beams, best first, with `length_penalty` and `early_stopping`; streamed, they come whole at
its end, as vLLM's),
`truncate_prompt_tokens` (only the prompt's last N tokens are answered, -1: as many as the
context holds; preprocessing cuts them; not with echo), `return_token_ids` (the prompt's and
each choice's token ids: `prompt_token_ids` on a
completion's choices and on a chat answer, `token_ids` per choice; streamed, the ids each chunk
carries, the prompt's on the first), `return_tokens_as_token_ids` (logprobs name tokens
`token_id:N`; the frontend's
`--return-tokens-as-token-ids` makes it the default), `prompt_logprobs` (0..20: each prompt
token's log probability after the first, its rank and its position's N likeliest tokens,
vLLM's layout: the choice's `prompt_logprobs` in completions, the answer's in chat; not with
stream, as vLLM), `cache_salt`,
`chat_template_kwargs` (more variables for the chat template, e.g. Qwen3's
`enable_thinking`), `add_generation_prompt` and `continue_final_message` (the last message
is continued, as a prefilled answer); OpenAI's `prediction` (predicted outputs: the engine
drafts from its tokens, `draft_input_ids`; usage's `completion_tokens_details` counts the
draft tokens kept and rejected); vLLM's `priority` (lower runs first); ours
`session_id` (the ensemble's: a conversation's pages are kept longer); TensorRT-LLM's
`no_repeat_ngram_size` (no n-gram of the text so far is generated again); chat's `tools`,
`tool_choice` and `parallel_tool_calls`, assistant messages' `tool_calls` and `tool` messages
(`tools.py`). Fields this server cannot honour with a value that asks for something
(the legacy `functions`, `best_of` other than n, `suffix`, images) are
rejected with a 400 that names them, never
silently dropped; other unknown fields are ignored, as OpenAI's SDK sends some (`user`, ...).
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.openai_api.errors import RequestError
from backend.openai_api.tools import ToolPlan, message_calls, parse_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 64  # the ensemble's num_return_sequences limit
MAX_LOGPROBS = 20  # alternatives a position may return (the engine's limit, as vLLM's)
INT32_MAX = (1 << 31) - 1  # the ensemble's integer inputs are INT32 (the seed UINT64)
MIN_LOGPROB = -9999.0  # JSON has no -inf: vLLM's floor
ROLES = ("system", "developer", "user", "assistant", "tool")
# The engine's finish reasons -> OpenAI's ("cancelled": vLLM's "abort").
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


@dataclass
class Plan:
    """One OpenAI request, ready for the ensemble: a Triton request per prompt."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: list[str]  # token-id prompts: their text, once the server's tokenizer made it
    fields: dict[str, Any]  # ensemble inputs shared by the prompts (not text_input, max_tokens)
    max_tokens: int | None  # None: up to the context limit
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids
    truncate: int | None = None  # vLLM's truncate_prompt_tokens: keep the last N (-1: context)
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N" (None: not given)
    token_ids_named: bool | None = None
    stop: list[str] = field(default_factory=list)  # the client's stop strings (text level)
    echo: bool = False
    logprobs: int | None = None  # None: not asked; else the alternatives a position returns
    prompt_logprobs: int | None = None  # vLLM's: None, or the alternatives a prompt position
    beam: bool = False  # vLLM's use_beam_search (n > 1): the choices are the n beams
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: end on these tokens
    stop_token_words: dict[str, int] = field(default_factory=dict)  # their texts (stop words)
    include_stop: bool = False  # vLLM's include_stop_str_in_output: keep the stop string
    keep_special: bool = False  # vLLM's skip_special_tokens false: special tokens written
    prediction: str | None = None  # OpenAI's predicted output (its text)
    prompt_ids: list[list[int] | None] = field(default_factory=list)  # a token-id prompt's
    tools: ToolPlan | None = None  # chat with tools (tools.py)
    created: int = field(default_factory=lambda: int(time.time()))
    # The answer's id after its prefix (the client's X-Request-Id / request_id where it sent
    # one): also the Triton requests' id.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"


def parse_completion(body: Any, models: Container[str]) -> Plan:
    body = json_object(body)
    model = _model(body, models)
    prompt = body.get("prompt")
    ids: list[list[int] | None] = []
    if isinstance(prompt, str):
        prompts = [prompt]
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        prompts, ids = [""], [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
        prompts, ids = [""] * len(prompt), [list(p) for p in prompt]
    else:
        raise RequestError("'prompt' must be a string, a non-empty list of strings, a list of "
                           "token ids or a list of such lists", "prompt")
    _refuse(body, "suffix", "'suffix' (insertion) is not supported")
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", n, 1, MAX_N)
    if best_of != n:
        raise RequestError(f"'best_of' other than n ({best_of} != {n}) is not supported",
                           "best_of")
    max_tokens = _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 1)
    plan = Plan("completion", model, prompts, {}, max_tokens, n,
                echo=_bool(body, "echo", False),
                logprobs=_int(body, "logprobs", None, 0, MAX_LOGPROBS), prompt_ids=ids)
    _common(body, plan)
    _adapter(plan, models)
    if plan.echo and plan.logprobs is not None:  # the prompt's tokens are returned too
        plan.fields["return_prompt_log_probs"] = True
    return plan


def parse_chat(body: Any, models: Container[str], template: Any) -> Plan:
    """`template`: a `chat.ChatTemplate` (None: the model has none, a 400)."""
    body = json_object(body)
    model = _model(body, models)
    messages = chat_messages(body.get("messages"))
    tools = parse_tools(body)
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if template is None:
        raise RequestError("the model has no chat template (tokenizer_config.json's "
                           "chat_template): use /v1/completions", "messages")
    prompt = render_chat(body, messages, template, tools)
    # max_completion_tokens (OpenAI's, max_tokens deprecated) wins where both are sent, as
    # in vLLM and SGLang; each is checked
    limit = _int(body, "max_completion_tokens", None, 1)
    max_tokens = _int(body, "max_tokens", None, 1)
    max_tokens = limit if limit is not None else max_tokens
    plan = Plan("chat", model, [prompt], {}, max_tokens, _int(body, "n", 1, 1, MAX_N),
                logprobs=(top or 0) if wanted else None, tools=tools)
    _common(body, plan)
    _adapter(plan, models)
    guide = tools.guide() if tools is not None else None
    if guide is not None:
        if "guided_decoding_guide_type" in plan.fields:
            raise RequestError(f"tool_choice {body.get('tool_choice')!r} is guided decoding: it "
                               "cannot come with response_format or guided_*", "tool_choice")
        plan.fields["guided_decoding_guide_type"], plan.fields["guided_decoding_guide"] = guide
    if not body.get("ignore_eos"):  # the template's turn end and the model's end ids
        words = plan.fields.setdefault("stop_words", [])
        words.extend(w for w in template.stop_words if w not in words)
    return plan


def tokenize_body(body: Any, models: Container[str], tokenizer: Any, template: Any,
                  max_model_len: int, names: TokenNames | None = None) -> dict[str, Any]:
    """vLLM's `/tokenize`: a `prompt` (`add_special_tokens` default true) or chat `messages`
    rendered as `/v1/chat/completions` would (default false) -> its token ids and count;
    `return_token_strs` adds each token's name."""
    body = json_object(body)
    _model(body, models)
    if tokenizer is None:
        raise RequestError("the frontend found no tokenizer for this model")
    if "messages" in body:
        if template is None:
            raise RequestError("the model has no chat template", "messages")
        text = render_chat(body, chat_messages(body.get("messages")), template,
                           parse_tools(body))
        special = _bool(body, "add_special_tokens", False)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise RequestError("'prompt' (a string) or 'messages' is required", "prompt")
        special = _bool(body, "add_special_tokens", True)
    ids = tokenizer.encode(text, add_special_tokens=special)
    strs = None
    if _bool(body, "return_token_strs", False):
        strs = [(names or TokenNames(tokenizer))(t)[0] for t in ids]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize_body(body: Any, models: Container[str], tokenizer: Any) -> dict[str, Any]:
    """vLLM's `/detokenize`: `tokens` (ids) -> their text, special tokens included."""
    body = json_object(body)
    _model(body, models)
    if tokenizer is None:
        raise RequestError("the frontend found no tokenizer for this model")
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise RequestError("'tokens' must be a list of token ids", "tokens")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise RequestError(f"'tokens' must be a list of token ids, tokens[{i}] is {t!r:.40}",
                               "tokens")
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary "
                           f"[0, {tokenizer.vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def prompt_texts(plan: Plan, tokenizer: Any, add_special_tokens: bool) -> None:
    """Token-id prompts -> their text (what the ensemble takes), kept only where the server's
    tokenizer (preprocessing's `add_special_tokens`) encodes it back to the same ids, so the
    model sees exactly the ids sent; a 400 otherwise, or without a tokenizer."""
    for i, ids in enumerate(plan.prompt_ids):
        if ids is None:
            continue
        where = f"prompt[{i}]" if len(plan.prompt_ids) > 1 else "prompt"
        if tokenizer is None:
            raise RequestError(f"{where}: token ids need the model's tokenizer, which the "
                               "frontend did not find: send the text", "prompt")
        vocab = tokenizer.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise RequestError(f"{where}: token id {bad[0]} is outside the vocabulary "
                               f"[0, {vocab})", "prompt")
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=add_special_tokens) != ids:
            raise RequestError(f"{where}: these token ids are not how the server's tokenizer "
                               f"encodes their text {text[:40]!r}: send the text", "prompt")
        plan.prompts[i] = text


def render_chat(body: Mapping[str, Any], messages: list[dict[str, Any]], template: Any,
                tools: ToolPlan | None = None) -> str:
    """The chat's prompt text, with the request's tools, `chat_template_kwargs`,
    `add_generation_prompt` (default true) and `continue_final_message` (default false; the
    last message, open, is continued: it cannot come with a generation prompt)."""
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    cont = _bool(body, "continue_final_message", False)
    generation = _bool(body, "add_generation_prompt", not cont)
    if cont and generation:
        raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both "
                           "be true", "continue_final_message")
    try:
        return template.render(messages, add_generation_prompt=generation, extra=extra,
                               continue_final_message=cont,
                               tools=tools.tools if tools is not None else None)
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from None


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as [{"role", "content"}] with text content (parts joined); "developer" is
    passed as "system", which chat templates know; an assistant's `tool_calls` (arguments as
    objects) and `reasoning_content` (vLLM's; or `reasoning`: Qwen3's templates show an
    earlier step's thinking in a tool-calling turn) and a tool message's `tool_call_id` are
    kept for the template."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}", where)
        calls = message.get("tool_calls")
        if calls not in (None, []) and role != "assistant":
            raise RequestError(f"{where}.tool_calls: only an assistant message has them", where)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                        part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RequestError(f"{where}.content[{j}]: only text parts are supported, "
                                       f"got {kind!r}", where)
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM and TensorRT-LLM join a message's parts
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of text parts", where)
        entry = {"role": "system" if role == "developer" else role, "content": content}
        if calls not in (None, []):
            entry["tool_calls"] = message_calls(calls, where)
        thought = message.get("reasoning_content", message.get("reasoning"))
        if thought is not None and role == "assistant":
            if not isinstance(thought, str):
                raise RequestError(f"{where}.reasoning_content must be a string", where)
            entry["reasoning_content"] = thought
        if role == "tool":
            call = message.get("tool_call_id")
            if call is not None and not isinstance(call, str):
                raise RequestError(f"{where}.tool_call_id must be a string", where)
            entry["tool_call_id"] = call
        out.append(entry)
    return out


def _common(body: Mapping[str, Any], plan: Plan) -> None:
    """The sampling, stop, guide, cache and streaming fields both endpoints share."""
    fields = plan.fields
    bias = _logit_bias(body)
    if bias:
        fields["embedding_bias_token_ids"] = [token for token, _ in bias]
        fields["embedding_bias_token_weights"] = [value for _, value in bias]
    plan.prompt_logprobs = _int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    top = plan.logprobs or 0  # the engine returns one count of alternatives for both
    if plan.prompt_logprobs is not None:
        fields["return_prompt_log_probs"] = True
        top = max(top, plan.prompt_logprobs)
    if plan.logprobs is not None:
        fields["return_log_probs"] = True
    if top:
        fields["num_top_log_probs"] = top
    numbers = (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
               ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
               ("repetition_penalty", 0.0, None))
    for name, low, high in numbers:
        value = _number(body, name, low, high)
        if value is not None:
            fields[name] = value
    if "top_p" in fields and fields["top_p"] == 0.0:
        raise RequestError("'top_p' must be greater than 0", "top_p")
    if "repetition_penalty" in fields and fields["repetition_penalty"] == 0.0:
        raise RequestError("'repetition_penalty' must be greater than 0", "repetition_penalty")
    top_k = _int(body, "top_k", None, -1)
    if top_k is not None:
        fields["top_k"] = max(top_k, 0)  # vLLM's -1 (all tokens) is the ensemble's 0
    seed = _int(body, "seed", None, 0, (1 << 64) - 1)
    if seed is not None:
        fields["seed"] = seed
    min_tokens = _int(body, "min_tokens", None, 0)
    if min_tokens:
        fields["min_tokens"] = min_tokens
    no_repeat = _int(body, "no_repeat_ngram_size", None, 0)
    if no_repeat:
        fields["no_repeat_ngram_size"] = no_repeat
    if _bool(body, "ignore_eos", False):
        fields["end_id"] = -1
    if plan.n > 1:
        fields["num_return_sequences"] = plan.n
    _beam_search(body, plan)
    plan.stop = _stop(body.get("stop"))
    if plan.stop:
        fields["stop_words"] = list(plan.stop)
    _vllm_text_options(body, plan)
    plan.prediction = _prediction(body.get("prediction"))
    priority = _int(body, "priority", None)
    if priority:
        fields["priority"] = priority
    for name in ("cache_salt", "session_id"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise RequestError(f"'{name}' must be a non-empty string", name)
            fields[name] = value
    guide = _guide(body)
    if guide is not None:
        fields["guided_decoding_guide_type"], fields["guided_decoding_guide"] = guide
    plan.stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not plan.stream:
            raise RequestError("'stream_options' is only allowed with stream: true",
                               "stream_options")
        if not isinstance(options, dict):
            raise RequestError("'stream_options' must be an object", "stream_options")
        plan.include_usage = _bool(options, "include_usage", False, "stream_options.")
        # vLLM's: usage so far on every chunk too (with include_usage, as vLLM's)
        plan.continuous_usage = plan.include_usage and _bool(
            options, "continuous_usage_stats", False, "stream_options.")
    if plan.stream and plan.prompt_logprobs is not None:
        raise RequestError("'prompt_logprobs' is not available with 'stream': true",
                           "prompt_logprobs")


def _vllm_text_options(body: Mapping[str, Any], plan: Plan) -> None:
    """vLLM's `stop_token_ids` (resolved against the tokenizer by `stop_token_texts`),
    `include_stop_str_in_output`, `bad_words`, `truncate_prompt_tokens` (resolved by the
    run: -1 is the context length), `allowed_token_ids` (the engine checks them against the
    vocabulary), `skip_special_tokens` (false: the run writes the text from the ids) and the
    token-id options. `spaces_between_special_tokens` (checked a boolean) changes nothing:
    the served tokenizer is a fast (`tokenizers`) one, which joins special tokens without
    spaces whatever it says, as vLLM's fast tokenizers do (only its slow ones insert them)."""
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_id(t) for t in ids):
            raise RequestError("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        plan.stop_token_ids = list(dict.fromkeys(ids))
    plan.include_stop = _bool(body, "include_stop_str_in_output", False)
    plan.return_token_ids = _bool(body, "return_token_ids", False)
    if body.get("return_tokens_as_token_ids") is not None:  # else the server's default
        plan.token_ids_named = _bool(body, "return_tokens_as_token_ids", False)
    words = body.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise RequestError("'bad_words' must be a list of non-empty strings", "bad_words")
        if words:
            plan.fields["bad_words"] = list(dict.fromkeys(words))
    plan.keep_special = not _bool(body, "skip_special_tokens", True)
    _bool(body, "spaces_between_special_tokens", True)  # a fast tokenizer's: no spaces
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or \
                not all(_is_id(t) for t in allowed):
            raise RequestError("'allowed_token_ids' must be a non-empty list of token ids "
                               "(integers >= 0)", "allowed_token_ids")
        if max(allowed) > INT32_MAX:  # (the server checks them against the vocabulary)
            raise RequestError(f"'allowed_token_ids': token id {max(allowed)} is outside the "
                               "vocabulary", "allowed_token_ids")
        plan.fields["allowed_token_ids"] = list(dict.fromkeys(allowed))
    keep = body.get("truncate_prompt_tokens")
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, int) or not (keep >= 1 or keep == -1):
            raise RequestError("'truncate_prompt_tokens' must be a positive number of tokens "
                               "(or -1: the model's context length)", "truncate_prompt_tokens")
        if plan.echo:
            raise RequestError("'truncate_prompt_tokens' cannot be used with 'echo' (the "
                               "echoed prompt would not be the one answered)",
                               "truncate_prompt_tokens")
        plan.truncate = keep


def _prediction(value: Any) -> str | None:
    """OpenAI's `prediction`: {"type": "content", "content": a string or text parts}."""
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(value, dict) or value.get("type") != "content" or \
            not isinstance(content, str):
        raise RequestError("'prediction' must be {\"type\": \"content\", \"content\": a string "
                           "or a list of text parts}", "prediction")
    return content


def prediction_ids(plan: Plan, tokenizer: Any) -> None:
    """The predicted output's token ids for the ensemble (`draft_input_ids`: the engine drafts
    from them), and the per-request draft counts (perf metrics) for the usage's
    `completion_tokens_details`. A hint: without a tokenizer it is left out."""
    if not plan.prediction or tokenizer is None:
        return
    plan.fields["draft_input_ids"] = tokenizer.encode(plan.prediction, add_special_tokens=False)
    plan.fields["return_perf_metrics"] = True


def stop_token_texts(plan: Plan, tokenizer: Any) -> None:
    """`stop_token_ids` -> stop words for the ensemble (the token's text, kept only where the
    server's tokenizer encodes it back to that one token, so the engine ends on exactly it;
    its text stays in the output, as vLLM's does unless it is special); a 400 otherwise."""
    if not plan.stop_token_ids:
        return
    if tokenizer is None:
        raise RequestError("'stop_token_ids' need the model's tokenizer, which the frontend "
                           "did not find: use 'stop'", "stop_token_ids")
    words = plan.fields.setdefault("stop_words", [])
    for token in plan.stop_token_ids:
        if token >= tokenizer.vocab_size:
            raise RequestError(f"'stop_token_ids': token id {token} is outside the vocabulary "
                               f"[0, {tokenizer.vocab_size})", "stop_token_ids")
        text = tokenizer.decode([token], skip_special_tokens=False)
        if not text or tokenizer.encode(text) != [token]:
            raise RequestError(f"'stop_token_ids': token {token} ({text!r}) is not one token "
                               "when its text is encoded again: use 'stop'", "stop_token_ids")
        if text not in words:
            words.append(text)
        plan.stop_token_words.setdefault(text, token)


def special_stop_ids(plan: Plan, tokenizer: Any) -> dict[int, str]:
    """The stop words sent to the ensemble (the chat template's turn end, stop_token_ids,
    `stop`) that are one special token each (it writes no text unless asked to): id -> the
    word."""
    ids = {}
    for word in plan.fields.get("stop_words", []):
        tokens = tokenizer.encode(word, add_special_tokens=False)
        if len(tokens) == 1 and not tokenizer.decode(tokens, skip_special_tokens=True):
            ids[tokens[0]] = word
    return ids


def stop_reason(engine_reason: str, stop: StopFilter, text_tail: str,
                token_words: Mapping[str, int], last_id: int | None = None,
                special_strings: Mapping[int, str] | None = None) -> str | int | None:
    """vLLM's `stop_reason` for a choice that ended: the stop string that cut it (or, where a
    stop string is one special token's text, `special_strings`, which the engine stopped at
    though the text never shows it: that string), or the stop token it ended on: its last
    generated id (`last_id`) where that is one, else the one whose text ends the choice's
    text (`text_tail`, the last characters generated; a special token writes none); None
    where it ended otherwise (EOS, length, a chat template's stop word)."""
    if stop.stopped:
        return stop.matched
    if engine_reason == "stop":
        if special_strings and last_id in special_strings:
            return special_strings[last_id]
        if last_id is not None and last_id in token_words.values():
            return last_id
        for word in sorted(token_words, key=len, reverse=True):
            if text_tail.endswith(word):
                return token_words[word]
    return None


def _beam_search(body: Mapping[str, Any], plan: Plan) -> None:
    """vLLM's `use_beam_search`: a beam search n wide whose n beams, best first, are the
    choices (one wide: greedy decoding); `length_penalty` and `early_stopping` rank and end
    its beams, and ask for something only with it (their neutral values pass)."""
    penalty = _number(body, "length_penalty", -math.inf, None)
    early = _bool(body, "early_stopping", False)
    if not _bool(body, "use_beam_search", False):
        for name, value, neutral in (("length_penalty", penalty, 1.0),
                                     ("early_stopping", early, False)):
            if value is not None and value != neutral:
                raise RequestError(f"'{name}' only applies with 'use_beam_search': true", name)
        return
    if plan.n == 1:  # a beam one wide is the likeliest token each step
        plan.fields["top_k"] = 1
        return
    plan.beam = True
    plan.fields["beam_width"] = plan.n
    if penalty is not None:
        plan.fields["length_penalty"] = penalty
    if early:
        plan.fields["early_stopping"] = True


def _guide(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(guide type, guide) from response_format, vLLM's guided_* fields or vLLM's newer
    `structured_outputs` object (json, regex, grammar, choice, json_object, structural_tag);
    at most one."""
    guides = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            guides.append(("json", ""))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise RequestError("response_format.json_schema.schema must be an object",
                                   "response_format")
            guides.append(("json_schema", json.dumps(schema)))
        elif kind != "text":
            raise RequestError("response_format.type must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r}", "response_format")
    guides += _guided_fields(body, "guided_")
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise RequestError("'structured_outputs' must be an object", "structured_outputs")
        unknown = sorted(set(structured) - STRUCTURED_OUTPUT_KEYS)
        if unknown:
            raise RequestError(f"'structured_outputs': {', '.join(unknown)} not supported "
                               f"(supported: {', '.join(sorted(STRUCTURED_OUTPUT_KEYS))})",
                               "structured_outputs")
        guides += _guided_fields(structured, "", "structured_outputs.")
        if _bool(structured, "json_object", False, "structured_outputs."):
            guides.append(("json", ""))
        tag = structured.get("structural_tag")
        if tag is not None:
            if not isinstance(tag, str) or not tag:
                raise RequestError("'structured_outputs.structural_tag' must be a non-empty "
                                   "string (the tag's JSON)", "structured_outputs")
            guides.append(("structural_tag", tag))
    if len(guides) > 1:
        raise RequestError("at most one of response_format (json), guided_json, guided_regex, "
                           "guided_grammar, guided_choice and structured_outputs' json, regex, "
                           "grammar, choice, json_object, structural_tag may be given",
                           "response_format")
    return guides[0] if guides else None


# vLLM's StructuredOutputsParams: the guides, and switches that hold here anyway (no fallback
# to another backend; JSON is written compact, without free whitespace)
STRUCTURED_OUTPUT_KEYS = frozenset({"json", "regex", "grammar", "choice", "json_object",
                                    "structural_tag", "disable_fallback",
                                    "disable_any_whitespace",
                                    "disable_additional_properties"})


def _guided_fields(fields: Mapping[str, Any], prefix: str,
                   where: str = "") -> list[tuple[str, str]]:
    """The guides among `fields`' {prefix}json / regex / grammar / choice (vLLM's guided_*
    fields, or its structured_outputs' keys: `where` names that object in errors)."""
    guides = []
    name = prefix + "json"
    value = fields.get(name)
    if value is not None:
        if isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise RequestError(f"'{where}{name}' must be a JSON schema (object or string)",
                               where.rstrip(".") or name)
        guides.append(("json_schema", value))
    for name, kind in ((prefix + "regex", "regex"), (prefix + "grammar", "ebnf_grammar")):
        value = fields.get(name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise RequestError(f"'{where}{name}' must be a non-empty string",
                                   where.rstrip(".") or name)
            guides.append((kind, value))
    name = prefix + "choice"
    choices = fields.get(name)
    if choices is not None:  # exactly one of the strings: a grammar of their literals
        if not isinstance(choices, list) or not choices or \
                not all(isinstance(c, str) and c for c in choices):
            raise RequestError(f"'{where}{name}' must be a non-empty list of non-empty strings",
                               where.rstrip(".") or name)
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
        guides.append(("ebnf_grammar", f"root ::= {literals}"))
    return guides


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise RequestError("'stop' must be a non-empty string or a list of them", "stop")
    return list(dict.fromkeys(values))


def json_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _model(body: Mapping[str, Any], models: Container[str]) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    if model not in models:
        raise RequestError(f"the model {model!r} does not exist", "model", 404,
                           code="model_not_found")
    return model


def _adapter(plan: Plan, models: Container[str]) -> None:
    """A served name that stands for a LoRA adapter (`models` maps names to adapters, None:
    the base model) runs the request on it."""
    if isinstance(models, Mapping) and models.get(plan.model):
        plan.fields["lora_name"] = models[plan.model]


def _logit_bias(body: Mapping[str, Any]) -> list[tuple[int, float]]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]} (the ids are checked against
    the vocabulary by `check_logit_bias` and by preprocessing)."""
    given = body.get("logit_bias")
    if given is None:
        return []
    if not isinstance(given, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to biases",
                           "logit_bias")
    out = []
    for key, value in given.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or str(token) != str(key).strip():
            raise RequestError(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        if token > INT32_MAX:
            raise RequestError(f"'logit_bias' token id {token} is outside the vocabulary",
                               "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise RequestError(f"'logit_bias' value for token {token} must be a number from "
                               f"-100 to 100, got {value!r}", "logit_bias")
        if value:
            out.append((token, float(value)))
    if len({token for token, _ in out}) != len(out):
        raise RequestError("'logit_bias' names a token id twice", "logit_bias")
    return out


def check_logit_bias(plan: Plan, tokenizer: Any) -> None:
    """`logit_bias` ids against the served tokenizer's vocabulary (where the frontend has it;
    preprocessing checks them too)."""
    ids = plan.fields.get("embedding_bias_token_ids")
    if not ids or tokenizer is None:
        return
    vocab = tokenizer.vocab_size
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise RequestError(f"'logit_bias' token id {bad[0]} is outside the vocabulary "
                           f"[0, {vocab})", "logit_bias")


def _refuse(body: Mapping[str, Any], name: str, message: str) -> None:
    """A 400 for a field this server cannot honour, unless it is absent, null or empty."""
    if body.get(name) not in ({}, [], None):
        raise RequestError(message, name)


def _int(body: Mapping[str, Any], name: str, default: int | None, low: int | None = None,
         high: int | None = None) -> int | None:
    """An integer field (the ensemble's inputs are 32-bit: the bounds default to int32's)."""
    low = -INT32_MAX - 1 if low is None else low
    high = INT32_MAX if high is None else high
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"'{name}' must be from {low} to {high}, got {value}", name)
    return value


def _is_number(value: Any) -> bool:
    """A JSON number a float holds: not a bool, not inf / nan, and not an integer past the
    float range (JSON's 1 followed by 400 zeros parses as a Python int)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -sys.float_info.max <= value <= sys.float_info.max
    return isinstance(value, float) and math.isfinite(value)


def _number(body: Mapping[str, Any], name: str, low: float, high: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise RequestError(f"'{name}' must be a number, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bounds = f"from {low}" + (f" to {high}" if high is not None else " up")
        raise RequestError(f"'{name}' must be {bounds}, got {value}", name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{where}{name}' must be true or false, got {value!r}",
                           f"{where}{name}")
    return value


class StopFilter:
    """The text of one choice as it streams, cut before the first stop string it holds
    (after it with `keep`).

    The last (longest stop - 1) characters are held back until the next text shows they do
    not begin a stop string, so no client ever sees part of one."""

    def __init__(self, stops: Sequence[str], keep: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.keep = keep  # include_stop_str_in_output: the stop string goes out too
        self.hold = max(map(len, self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string it stopped at (vLLM's stop_reason)

    def feed(self, text: str) -> str:
        """The text that can go to the client now (the stop string and what follows never)."""
        if self.stopped:
            return ""
        self.pending += text
        found = [(i, -len(s), s) for s, i in ((s, self.pending.find(s)) for s in self.stops)
                 if i >= 0]
        if found:
            at, minus_len, self.matched = min(found)  # the first; of those there, the longest
            end = at - minus_len if self.keep else at
            out, self.pending, self.stopped = self.pending[:end], "", True
            return out
        keep = min(self.hold, len(self.pending))
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        """What was held back, once the choice has ended."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


@dataclass
class TokenLogprob:
    """One returned token: its name and bytes, the model's log probability of it, where its
    text starts in the choice's text, and the likeliest tokens at its position."""

    token: str
    bytes: list[int]
    logprob: float | None  # None: a prompt's first token (nothing before it to score it)
    offset: int
    top: list[tuple[str, list[int], float]] = field(default_factory=list)


class TokenNames:
    """Token id -> (name, bytes) as OpenAI names tokens: the token's text where its bytes
    are UTF-8 on their own, else `bytes:\\xe2\\x80` (part of a character); `bytes` lets a
    client join them back. Cached (a name is asked for at every position it is a candidate).
    `by_id`: each token named `token_id:N` instead, its bytes those of that name (vLLM's
    return_tokens_as_token_ids), for clients that read the ids back."""

    def __init__(self, tokenizer: Any, by_id: bool = False) -> None:
        self.tokenizer = tokenizer
        self.by_id = by_id
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        named = self.cache.get(token_id)
        if named is None and self.by_id:
            name = f"token_id:{token_id}"
            named = self.cache[token_id] = (name, list(name.encode()))
        if named is None:
            raw = self.tokenizer.token_bytes(token_id)
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            named = self.cache[token_id] = (name, list(raw))
        return named

    def entry(self, token_id: int, logprob: float | None, offset: int,
              top: Sequence[tuple[int, float]] = ()) -> TokenLogprob:
        name, raw = self(token_id)
        return TokenLogprob(name, raw, None if logprob is None else _floor(logprob), offset,
                            [(*self(t), _floor(v)) for t, v in top])


def _floor(value: float) -> float:
    return max(float(value), MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


def prompt_logprobs_body(names: TokenNames, ids: Sequence[int], log_probs: Sequence[float],
                         ranks: Sequence[int], tops: Sequence[Sequence[tuple[int, float]]],
                         top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a dict from
    token id (a string, as JSON keys are) to {logprob, rank, decoded_token}: the prompt's
    token first, then its position's `top` likeliest tokens (ranks 1..top), the prompt's
    token once where it is one of them."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for i, token in enumerate(ids[1:]):
        entry = {str(token): {"logprob": _floor(log_probs[i]),
                              "rank": int(ranks[i]) if i < len(ranks) else None,
                              "decoded_token": names(token)[0]}}
        alternatives = tops[i][:top] if i < len(tops) else ()
        for rank, (t, v) in enumerate(alternatives, start=1):
            entry.setdefault(str(t), {"logprob": _floor(v), "rank": rank,
                                      "decoded_token": names(t)[0]})
        out.append(entry)
    return out


def logprobs_body(plan: Plan, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
    """A choice's `logprobs` for `entries` (None when the request did not ask): chat's
    `{"content": [{token, logprob, bytes, top_logprobs}]}` or completions'
    `{tokens, token_logprobs, top_logprobs, text_offset}` (each top_logprobs dict holds the
    returned token too, so up to logprobs + 1 entries, as OpenAI's; a prompt's first token
    has null for both, as OpenAI's echo gives it)."""
    if plan.logprobs is None:
        return None
    if plan.kind == "chat":
        return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
                             "top_logprobs": [{"token": t, "logprob": v, "bytes": b}
                                              for t, b, v in e.top]} for e in entries],
                "refusal": None}
    tops: list[dict[str, float] | None] = []
    for e in entries:
        top = {t: v for t, _, v in e.top}
        if e.logprob is not None:
            top.setdefault(e.token, e.logprob)
        tops.append(top if e.logprob is not None else None)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": [e.offset for e in entries]}


def finish_reason(engine_reason: str, stopped: bool) -> str:
    """OpenAI's finish_reason for a choice: "stop" where a stop string cut it."""
    if stopped:
        return "stop"
    return FINISH_REASONS.get(engine_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          predicted: tuple[int, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage; `predicted` (a request with a prediction): the draft tokens verified
    and kept, and those rejected."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens,
                            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if predicted is not None:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": predicted[0],
                                             "rejected_prediction_tokens": predicted[1]}
    return body


def chunk_body(plan: Plan, choices: list[dict[str, Any]],
               usage_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk (`text_completion` / `chat.completion.chunk`)."""
    body = {"id": plan.id, "object": "chat.completion.chunk" if plan.kind == "chat"
            else "text_completion", "created": plan.created, "model": plan.model,
            "choices": choices}
    if usage_body is not None:
        body["usage"] = usage_body
    return body


def stream_choice(plan: Plan, index: int, text: str | None, reason: str | None,
                  role: bool = False, logprobs: dict[str, Any] | None = None,
                  calls: Sequence[dict[str, Any]] = (), reasoning: str = "",
                  stop_reason: str | int | None = None,
                  token_ids: Sequence[int] | None = None,
                  prompt_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """One choice's part of a streamed chunk; `calls`: tool-call deltas, `reasoning`:
    reasoning text (chat); once it ended (`reason`), vLLM's `stop_reason` too; with vLLM's
    return_token_ids, the ids it carries (`token_ids`) and, on a completion's first chunk,
    its prompt's (`prompt_token_ids`)."""
    if plan.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None and (text or not (calls or reasoning)):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = list(calls)
        body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    else:
        body = {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": reason}
    if reason is not None:
        body["stop_reason"] = stop_reason
    if prompt_token_ids is not None and plan.kind != "chat":
        body["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        body["token_ids"] = list(token_ids)
    return body


def response_body(plan: Plan, texts: list[str | None], reasons: list[str],
                  usage_body: dict[str, Any],
                  logprobs: Sequence[dict[str, Any] | None] | None = None,
                  calls: Sequence[list[dict[str, Any]]] | None = None,
                  reasoning: Sequence[str | None] | None = None,
                  prompt_logprobs: Sequence[list | None] | None = None,
                  stop_reasons: Sequence[str | int | None] | None = None,
                  token_ids: Sequence[list[int]] | None = None,
                  prompt_token_ids: Sequence[list[int]] | None = None) -> dict[str, Any]:
    """The non-streamed answer: `chat.completion` / `text_completion`; `calls`: each chat
    choice's tool calls (a message with calls has content null where it has no text);
    `reasoning`: each chat choice's `reasoning_content` (None: no reasoning parser);
    `prompt_logprobs`: per prompt, vLLM's `prompt_logprobs` (None: not asked), on each of
    its choices (completions) or on the answer (chat); `stop_reasons`: each choice's vLLM
    `stop_reason` (the stop string or token id that ended it, else None); `token_ids` /
    `prompt_token_ids` (vLLM's return_token_ids): each choice's generated ids and each
    prompt's ids (on its choices in completions, on the answer in chat)."""
    logprobs = logprobs or [None] * len(texts)
    stop_reasons = stop_reasons or [None] * len(texts)
    calls = calls or [[] for _ in texts]
    if plan.kind == "chat":
        choices = []
        for i, (t, r, lp, c) in enumerate(zip(texts, reasons, logprobs, calls)):
            message: dict[str, Any] = {"role": "assistant", "content": t}
            if reasoning is not None:
                message["reasoning_content"] = reasoning[i]
            if c:
                message["tool_calls"] = c
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": r, "stop_reason": stop_reasons[i]})
        kind = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r,
                    "stop_reason": sr}
                   for i, (t, r, lp, sr) in enumerate(zip(texts, reasons, logprobs,
                                                          stop_reasons))]
        if prompt_logprobs is not None:
            for i, choice in enumerate(choices):
                choice["prompt_logprobs"] = prompt_logprobs[i // plan.n]
        if prompt_token_ids is not None:
            for i, choice in enumerate(choices):
                choice["prompt_token_ids"] = prompt_token_ids[i // plan.n]
        kind = "text_completion"
    if token_ids is not None:
        for choice, ids in zip(choices, token_ids):
            choice["token_ids"] = ids
    body = {"id": plan.id, "object": kind, "created": plan.created, "model": plan.model,
            "choices": choices, "usage": usage_body}
    if prompt_logprobs is not None and plan.kind == "chat":
        body["prompt_logprobs"] = prompt_logprobs[0]
    if prompt_token_ids is not None and plan.kind == "chat":
        body["prompt_token_ids"] = prompt_token_ids[0]
    return body
