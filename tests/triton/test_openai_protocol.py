"""The OpenAI frontend without a server: request bodies -> ensemble inputs, the errors for what
is wrong, stop strings cut across streamed pieces, chat templates and their turn ends."""

from __future__ import annotations

import json
import re

import pytest

from backend.openai_api.chat import ChatTemplate, TemplateError
from backend.openai_api.protocol import (
    RequestError,
    StopFilter,
    TokenNames,
    check_logit_bias,
    detokenize_body,
    finish_reason,
    logprobs_body,
    parse_chat,
    parse_completion,
    prompt_logprobs_body,
    prompt_texts,
    stop_reason,
    stop_token_texts,
    tokenize_body,
)
from backend.tokenizer import CHATML_TEMPLATE, byte_tokenizer

MODELS = ("ensemble", "tiny")
SPECIALS = byte_tokenizer().special_tokens  # <|endoftext|> 256, <|im_start|>, <|im_end|>, <|pad|>


def chatml(end_ids=(256,)) -> ChatTemplate:
    return ChatTemplate(CHATML_TEMPLATE, SPECIALS, eos_token="<|endoftext|>", end_ids=end_ids)


def test_completion_fields_map_to_ensemble_inputs():
    plan = parse_completion({
        "model": "tiny", "prompt": ["a", "b"], "max_tokens": 7, "n": 3, "temperature": 0.5,
        "top_p": 0.9, "seed": 11, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "stop": ["\n\n", "END", "END"], "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2,
        "min_tokens": 2, "ignore_eos": True, "cache_salt": "tenant", "session_id": "s1",
        "priority": -2, "stream": True, "stream_options": {"include_usage": True}, "echo": True,
        "user": "ignored", "logprobs": None, "logit_bias": {"5": 1, "70": -100.0, "9": 0},
        "best_of": 3, "no_repeat_ngram_size": 3}, MODELS)
    assert plan.kind == "completion" and plan.model == "tiny" and plan.prompts == ["a", "b"]
    assert plan.max_tokens == 7 and plan.n == 3 and plan.stream and plan.include_usage
    assert plan.echo and plan.stop == ["\n\n", "END"]
    assert plan.fields == {
        "temperature": 0.5, "top_p": 0.9, "min_p": 0.1, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "top_k": 0, "seed": 11,
        "min_tokens": 2, "no_repeat_ngram_size": 3, "end_id": -1, "num_return_sequences": 3,
        "stop_words": ["\n\n", "END"], "cache_salt": "tenant", "session_id": "s1",
        "priority": -2, "embedding_bias_token_ids": [5, 70],  # a zero bias is left out
        "embedding_bias_token_weights": [1.0, -100.0]}
    assert plan.id.startswith("cmpl-")
    assert "embedding_bias_token_ids" not in parse_completion(
        {"model": "tiny", "prompt": "x", "logit_bias": {}}, MODELS).fields
    defaults = parse_completion({"model": "ensemble", "prompt": "x"}, MODELS)
    assert defaults.max_tokens == 16 and defaults.fields == {} and defaults.n == 1
    assert not defaults.stream and not defaults.echo


BAD_COMPLETIONS = [
    ({"prompt": "x"}, "'model' must be a string", 400),
    ({"model": "gpt-4", "prompt": "x"}, "the model 'gpt-4' does not exist", 404),
    ({"model": "tiny"}, "'prompt' must be a string", 400),
    ({"model": "tiny", "prompt": []}, "'prompt' must be a string", 400),
    ({"model": "tiny", "prompt": [1, -2, 3]}, "'prompt' must be a string", 400),
    ({"model": "tiny", "prompt": [[1], []]}, "'prompt' must be a string", 400),
    ({"model": "tiny", "prompt": [[1], "x"]}, "'prompt' must be a string", 400),
    ({"model": "tiny", "prompt": [True, 2]}, "'prompt' must be a string", 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "'max_tokens' must be from 1", 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2.5}, "'max_tokens' must be an integer", 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": True}, "must be an integer", 400),
    # past int32 (the ensemble's inputs): a 400, not a wrapped or overflowing number
    ({"model": "tiny", "prompt": "x", "max_tokens": 3 * 10**9},
     "'max_tokens' must be from 1 to 2147483647", 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": 10**20}, "'max_tokens' must be from 1", 400),
    ({"model": "tiny", "prompt": "x", "priority": "high"}, "'priority' must be an integer", 400),
    ({"model": "tiny", "prompt": "x", "priority": 2**40}, "'priority' must be from", 400),
    ({"model": "tiny", "prompt": "x", "top_k": -(2**40)}, "'top_k' must be from -1", 400),
    ({"model": "tiny", "prompt": "x", "seed": 2**64}, "'seed' must be from 0 to", 400),
    ({"model": "tiny", "prompt": "x", "temperature": 2.5}, "'temperature' must be from 0.0", 400),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "must be a number", 400),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "'top_p' must be greater than 0", 400),
    ({"model": "tiny", "prompt": "x", "n": 65}, "'n' must be from 1 to 64", 400),
    ({"model": "tiny", "prompt": "x", "n": 2, "best_of": 4}, "'best_of' other than n", 400),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, "'logprobs' must be from 0 to 20", 400),
    ({"model": "tiny", "prompt": "x", "logprobs": True}, "'logprobs' must be an integer", 400),
    ({"model": "tiny", "prompt": "x", "prompt_logprobs": 21},
     "'prompt_logprobs' must be from 0 to 20", 400),
    ({"model": "tiny", "prompt": "x", "prompt_logprobs": 1, "stream": True},
     "'prompt_logprobs' is not available with 'stream': true", 400),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "'suffix'", 400),
    ({"model": "tiny", "prompt": "x", "no_repeat_ngram_size": -1},
     "'no_repeat_ngram_size' must be from 0", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": [5]}, "'logit_bias' must be an object", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"a": 1}}, "key 'a' is not a token id", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"-3": 1}}, "key '-3' is not a token", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, "from -100 to 100", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": "up"}}, "from -100 to 100", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 1, "05": 2}}, "key '05'", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": {str(2**40): 1}}, "outside the vocab", 400),
    ({"model": "tiny", "prompt": "x", "stop": [""]}, "'stop' must be a non-empty string", 400),
    ({"model": "tiny", "prompt": "x", "stop": 5}, "'stop'", 400),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
     "only allowed with stream: true", 400),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, "'stream' must be true or false", 400),
    ({"model": "tiny", "prompt": "x", "seed": -1}, "'seed' must be from 0", 400),
    ({"model": "tiny", "prompt": "x", "cache_salt": 3}, "'cache_salt' must be a non-empty", 400),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "yaml"}},
     "response_format.type must be", 400),
    ({"model": "tiny", "prompt": "x", "guided_regex": "a+", "guided_json": {}},
     "at most one of", 400),
]  # fmt: skip


@pytest.mark.parametrize("body, message, status", BAD_COMPLETIONS)
def test_bad_completion_requests_say_what_is_wrong(body, message, status):
    with pytest.raises(RequestError) as info:
        parse_completion(body, MODELS)
    assert message in info.value.message and info.value.status == status
    error = info.value.body()["error"]
    assert error["message"] == info.value.message and error["type"] == "invalid_request_error"


def test_logprobs_ask_the_ensemble_for_log_probabilities_and_alternatives():
    messages = [{"role": "user", "content": "x"}]
    none = parse_completion({"model": "tiny", "prompt": "x", "logprobs": None}, MODELS)
    assert none.logprobs is None and "return_log_probs" not in none.fields
    chosen = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 0}, MODELS)
    assert chosen.logprobs == 0 and chosen.fields == {"return_log_probs": True}
    five = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 5}, MODELS)
    assert five.fields == {"return_log_probs": True, "num_top_log_probs": 5}
    chat = parse_chat({"model": "tiny", "messages": messages, "logprobs": True,
                       "top_logprobs": 3}, MODELS, chatml())
    assert chat.logprobs == 3 and chat.fields["num_top_log_probs"] == 3
    only = parse_chat({"model": "tiny", "messages": messages, "logprobs": True}, MODELS,
                      chatml())
    assert only.logprobs == 0 and "num_top_log_probs" not in only.fields
    echo = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 1, "echo": True},
                            MODELS)
    assert echo.fields == {"return_log_probs": True, "num_top_log_probs": 1,
                           "return_prompt_log_probs": True}
    off = parse_chat({"model": "tiny", "messages": messages, "logprobs": False,
                      "top_logprobs": 0}, MODELS, chatml())
    assert off.logprobs is None and "return_log_probs" not in off.fields
    # vLLM's prompt_logprobs: the prompt scored, one count of alternatives for both (the
    # larger), without generated log probabilities unless asked.
    scored = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 1,
                               "prompt_logprobs": 4}, MODELS)
    assert scored.prompt_logprobs == 4 and scored.logprobs == 1
    assert scored.fields == {"return_log_probs": True, "num_top_log_probs": 4,
                             "return_prompt_log_probs": True}
    bare = parse_chat({"model": "tiny", "messages": messages, "prompt_logprobs": 0}, MODELS,
                      chatml())
    assert bare.logprobs is None and bare.fields.get("return_prompt_log_probs") is True
    assert "return_log_probs" not in bare.fields and "num_top_log_probs" not in bare.fields


def test_prompt_logprobs_body_is_vllms():
    names = TokenNames(byte_tokenizer())
    ids = [ord(c) for c in "abc"]
    tops = [[(ord("x"), -0.5), (ord("b"), -1.5)], [(ord("c"), float("-inf"))]]
    body = prompt_logprobs_body(names, ids, [-1.5, float("-inf")], [4, 1], tops, 2)
    assert body == [None,
                    {"98": {"logprob": -1.5, "rank": 4, "decoded_token": "b"},
                     "120": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}},
                    {"99": {"logprob": -9999.0, "rank": 1, "decoded_token": "c"}}]
    assert list(body[1]) == ["98", "120"]  # the prompt's token first; once
    assert prompt_logprobs_body(names, ids[:1], [], [], [], 3) == [None]


def test_token_names_are_text_or_bytes():
    names = TokenNames(byte_tokenizer())
    assert names(ord("A")) == ("A", [65])
    assert names(0xE2) == ("bytes:\\xe2", [0xE2])  # a lone lead byte: part of a character
    assert names(258) == ("<|im_end|>", list(b"<|im_end|>"))
    entry = names.entry(ord("h"), -0.25, 3, [(ord("h"), -0.25), (0xE2, float("-inf"))])
    assert entry.token == "h" and entry.offset == 3
    assert entry.top == [("h", [104], -0.25), ("bytes:\\xe2", [0xE2], -9999.0)]  # JSON: no -inf


def test_logprobs_bodies_take_openai_layouts():
    names = TokenNames(byte_tokenizer())
    entries = [names.entry(ord("h"), -0.5, 10, [(ord("j"), -0.25), (ord("h"), -0.5)]),
               names.entry(ord("i"), -2.0, 11, [(ord("o"), -0.1)])]
    completion = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 2}, MODELS)
    assert logprobs_body(completion, entries) == {
        "tokens": ["h", "i"], "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"j": -0.25, "h": -0.5}, {"o": -0.1, "i": -2.0}],  # the token too
        "text_offset": [10, 11]}
    first = names.entry(ord("x"), None, 0)  # an echoed prompt's first token: nothing scores it
    assert logprobs_body(completion, [first])["top_logprobs"] == [None]
    assert logprobs_body(completion, [first])["token_logprobs"] == [None]
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                       "logprobs": True, "top_logprobs": 1}, MODELS, chatml())
    body = logprobs_body(chat, entries)
    assert body["refusal"] is None and body["content"][1] == {
        "token": "i", "logprob": -2.0, "bytes": [105],
        "top_logprobs": [{"token": "o", "logprob": -0.1, "bytes": [111]}]}
    plain = parse_completion({"model": "tiny", "prompt": "x"}, MODELS)
    assert logprobs_body(plain, entries) is None


def test_token_id_prompts_are_sent_as_their_text_when_it_encodes_back():
    tok = byte_tokenizer()
    one = parse_completion({"model": "tiny", "prompt": [72, 105, 258]}, MODELS)
    two = parse_completion({"model": "tiny", "prompt": [[72, 105], [0xC3, 0xA9]]}, MODELS)
    assert one.prompt_ids == [[72, 105, 258]] and two.prompt_ids == [[72, 105], [0xC3, 0xA9]]
    prompt_texts(one, tok, True)
    prompt_texts(two, tok, True)
    assert one.prompts == ["Hi<|im_end|>"] and two.prompts == ["Hi", "é"]
    text = parse_completion({"model": "tiny", "prompt": ["a", "b"]}, MODELS)
    prompt_texts(text, tok, True)
    assert text.prompts == ["a", "b"]  # text prompts untouched
    for ids, message in (([0xE2], "are not how the server's tokenizer encodes"),  # half a char
                         ([72, 999], "token id 999 is outside the vocabulary [0, 260)")):
        plan = parse_completion({"model": "tiny", "prompt": [ids, [72]]}, MODELS)
        with pytest.raises(RequestError, match=r"prompt\[0\]: ") as info:
            prompt_texts(plan, tok, True)
        assert message in info.value.message and info.value.status == 400
    with pytest.raises(RequestError, match="need the model's tokenizer"):
        prompt_texts(parse_completion({"model": "tiny", "prompt": [72]}, MODELS), None, True)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    tok = byte_tokenizer()
    body = {"model": "tiny", "prompt": "x", "logit_bias": {"259": 5, "260": -5}}
    with pytest.raises(RequestError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        check_logit_bias(parse_completion(body, MODELS), tok)
    check_logit_bias(parse_completion({**body, "logit_bias": {"259": 5}}, MODELS), tok)
    check_logit_bias(parse_completion(body, MODELS), None)  # no tokenizer: preprocessing checks


def test_continue_final_message_leaves_the_last_message_open():
    messages = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "The color is "}]
    plan = parse_chat({"model": "tiny", "messages": messages, "continue_final_message": True},
                      MODELS, chatml())
    assert plan.prompts == ["<|im_start|>user\nName a color.<|im_end|>\n"
                            "<|im_start|>assistant\nThe color is "]  # its trailing space kept
    closed = parse_chat({"model": "tiny", "messages": messages,
                         "add_generation_prompt": False}, MODELS, chatml())
    assert closed.prompts[0].endswith("The color is <|im_end|>\n")
    with pytest.raises(RequestError, match="cannot both be true"):
        parse_chat({"model": "tiny", "messages": messages, "continue_final_message": True,
                    "add_generation_prompt": True}, MODELS, chatml())
    hidden = ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}", SPECIALS)
    with pytest.raises(RequestError, match="does not appear in the rendered chat"):
        parse_chat({"model": "tiny", "messages": messages, "continue_final_message": True},
                   MODELS, hidden)


def test_tokenize_and_detokenize_use_the_served_tokenizer():
    tok = byte_tokenizer()
    out = tokenize_body({"model": "tiny", "prompt": "Hi!", "return_token_strs": True}, MODELS,
                        tok, chatml(), 2048)
    assert out == {"count": 3, "max_model_len": 2048, "tokens": [72, 105, 33],
                   "token_strs": ["H", "i", "!"]}
    chat = tokenize_body({"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                         MODELS, tok, chatml(), 2048)
    assert chat["tokens"] == tok.encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")
    assert detokenize_body({"model": "tiny", "tokens": chat["tokens"]}, MODELS, tok) == {
        "prompt": "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"}
    for body, message in (({"model": "tiny"}, "'prompt' (a string) or 'messages'"),
                          ({"model": "nope", "prompt": "x"}, "does not exist")):
        with pytest.raises(RequestError) as info:
            tokenize_body(body, MODELS, tok, chatml(), 2048)
        assert message in info.value.message
    for tokens, message in (([1, 999], "token id 999 is outside the vocabulary"),
                            ("abc", "'tokens' must be a list of token ids"),
                            ([3, -1], r"token id -1 is outside the vocabulary \[0, "),
                            ([3, "a"], r"tokens\[1\] is 'a'"), ([True], r"tokens\[0\] is True")):
        with pytest.raises(RequestError, match=message):
            detokenize_body({"model": "tiny", "tokens": tokens}, MODELS, tok)


def test_not_an_object_is_refused():
    with pytest.raises(RequestError, match="must be a JSON object"):
        parse_completion(["model", "tiny"], MODELS)


def test_chat_renders_the_template_and_stops_at_the_turn_end():
    plan = parse_chat({"model": "ensemble", "max_completion_tokens": 9, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                         "text": "there"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "And?"}], "stop": "X"}, MODELS, chatml())
    assert plan.prompts == ["<|im_start|>system\nBe brief.<|im_end|>\n"
                            "<|im_start|>user\nHi \nthere<|im_end|>\n"  # parts: "\n"
                            "<|im_start|>assistant\n<|im_end|>\n"
                            "<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n"]
    assert plan.max_tokens == 9 and plan.kind == "chat" and plan.id.startswith("chatcmpl-")
    # the client's stop string first, then the template's turn end and the model's end id
    assert plan.fields["stop_words"] == ["X", "<|im_end|>", "<|endoftext|>"]
    assert plan.stop == ["X"]  # only the client's are cut from the text
    unbounded = parse_chat({"model": "ensemble", "messages": [{"role": "user", "content": "x"}],
                            "ignore_eos": True}, MODELS, chatml())
    assert unbounded.max_tokens is None  # up to the context limit
    assert unbounded.fields == {"end_id": -1}  # no turn end either


def test_chat_guides_from_response_format():
    messages = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    plan = parse_chat({"model": "tiny", "messages": messages, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}, MODELS,
        chatml())
    assert plan.fields["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(plan.fields["guided_decoding_guide"]) == schema
    plan = parse_chat({"model": "tiny", "messages": messages,
                       "response_format": {"type": "json_object"}}, MODELS, chatml())
    assert plan.fields["guided_decoding_guide_type"] == "json"
    plan = parse_chat({"model": "tiny", "messages": messages, "guided_grammar": "root ::= \"a\""},
                      MODELS, chatml())
    assert plan.fields["guided_decoding_guide_type"] == "ebnf_grammar"


def test_structured_outputs_are_the_guided_fields():
    """vLLM's structured_outputs object gives the same guides as its guided_* fields."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def guide(**body) -> tuple[str, str] | None:
        fields = parse_completion({"model": "tiny", "prompt": "x", **body}, MODELS).fields
        kind = fields.get("guided_decoding_guide_type")
        return None if kind is None else (kind, fields["guided_decoding_guide"])

    for old, new in ((dict(guided_json=schema), dict(json=schema)),
                     (dict(guided_json=json.dumps(schema)), dict(json=json.dumps(schema))),
                     (dict(guided_regex="a+b"), dict(regex="a+b")),
                     (dict(guided_grammar='root ::= "a"'), dict(grammar='root ::= "a"')),
                     (dict(guided_choice=["yes", "no"]), dict(choice=["yes", "no"])),
                     (dict(response_format={"type": "json_object"}), dict(json_object=True))):
        assert guide(**old) == guide(structured_outputs=new) is not None
    tag = json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})
    assert guide(structured_outputs={"structural_tag": tag}) == ("structural_tag", tag)
    assert guide(structured_outputs={"regex": "a", "disable_fallback": True}) == ("regex", "a")
    assert guide(structured_outputs={}) is None
    assert guide(structured_outputs={"json_object": False}) is None
    for body, message in (
            ({"structured_outputs": "a+"}, "'structured_outputs' must be an object"),
            ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
             "whitespace_pattern not supported"),
            ({"structured_outputs": {"choice": []}},
             "'structured_outputs.choice' must be a non-empty list"),
            ({"structured_outputs": {"regex": 5}}, "'structured_outputs.regex' must be"),
            ({"structured_outputs": {"json": 5}}, "'structured_outputs.json' must be a JSON"),
            ({"structured_outputs": {"structural_tag": {}}}, "structural_tag' must be a"),
            ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "at most one of"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "at most one of")):
        with pytest.raises(RequestError, match=re.escape(message)):
            parse_completion({"model": "tiny", "prompt": "x", **body}, MODELS)


BAD_CHATS = [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text parts are supported, got 'image_url'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0].function must be an object"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     "'tool_choice' needs 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2},
     "'logprobs' must be true or false"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "'top_logprobs' needs 'logprobs': true"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "'top_logprobs' must be from 0 to 20"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "'max_completion_tokens' must be from 1"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0] must be"),
]  # fmt: skip


@pytest.mark.parametrize("body, message", BAD_CHATS)
def test_bad_chat_requests_say_what_is_wrong(body, message):
    with pytest.raises(RequestError) as info:
        parse_chat({"model": "tiny", **body}, MODELS, chatml())
    assert message in info.value.message and info.value.status == 400


def test_chat_without_a_template_is_refused():
    with pytest.raises(RequestError, match="no chat template"):
        parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, MODELS,
                   None)


def test_a_template_that_raises_is_a_bad_request():
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception("
                          "'conversations start with the user') }}{% endif %}"
                          "{% for m in messages %}{{ m['content'] }}{% endfor %}", SPECIALS)
    with pytest.raises(TemplateError, match="start with the user"):
        strict.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(RequestError, match="start with the user"):
        parse_chat({"model": "tiny", "messages": [{"role": "system", "content": "x"}]}, MODELS,
                   strict)


def test_turn_end_is_found_for_other_templates():
    llama3 = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
              "{% endif %}")
    specials = {"<|start_header_id|>": 1, "<|end_header_id|>": 2, "<|eot_id|>": 3,
                "<|end_of_text|>": 4}
    assert ChatTemplate(llama3, specials, end_ids=[4, 3]).stop_words == [
        "<|eot_id|>", "<|end_of_text|>"]
    # A template whose turns end in plain text has no special turn end; end ids remain.
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert ChatTemplate(plain, specials, end_ids=[4]).stop_words == ["<|end_of_text|>"]
    assert chatml(end_ids=()).stop_words == ["<|im_end|>"]


def test_template_from_the_default_models_folder(tmp_path):
    from backend.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    template = ChatTemplate.from_dir(tmp_path, SPECIALS)
    assert template is not None and template.stop_words == ["<|im_end|>", "<|endoftext|>"]
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_dir(tmp_path, SPECIALS) is None


def feed_all(stop: StopFilter, pieces: list[str]) -> str:
    out = "".join(stop.feed(p) for p in pieces)
    return out + stop.flush()


@pytest.mark.parametrize("pieces", [["Hello wor", "ld. STOP here"], ["Hello world. S", "T",
                                    "OP", " here"], list("Hello world. STOP here")])
def test_stop_string_is_cut_wherever_the_pieces_split_it(pieces):
    stop = StopFilter(["STOP", "zz"])
    sent = []
    for piece in pieces:
        sent.append(stop.feed(piece))
        assert "S" not in "".join(sent)  # nothing of the stop string ever went out
    assert "".join(sent) + stop.flush() == "Hello world. " and stop.stopped


def test_earliest_stop_string_wins_and_text_without_one_is_whole():
    stop = StopFilter(["world", "lo"])
    assert feed_all(stop, ["Hello world"]) == "Hel" and stop.stopped
    free = StopFilter(["xyz"])
    assert feed_all(free, ["abc", "xy", "z"[:0], "d"]) == "abcxyd" and not free.stopped
    none = StopFilter([])
    assert none.feed("abc") == "abc" and none.flush() == ""


@pytest.mark.parametrize("pieces", [["Hello wor", "ld. STOP here zz"],
                                    list("Hello world. STOP here zz")])
def test_include_stop_str_in_output_keeps_the_first_stop_string(pieces):
    stop = StopFilter(["zz", "STOP"], keep=True)
    assert feed_all(stop, pieces) == "Hello world. STOP" and stop.stopped
    assert stop.flush() == ""
    assert stop.matched == "STOP"
    both = StopFilter(["ST", "STOP"], keep=True)  # found at one place at once: the longest
    assert feed_all(both, ["Hello world. STOP"]) == "Hello world. STOP"
    assert both.matched == "STOP"


def test_stop_reason_names_the_stop_string_or_token():
    """vLLM's stop_reason: the stop string the filter cut at, else the stop token whose text
    ends the generated text (the longest such) when the engine stopped at a stop word."""
    words = {"q": 113, "aq": 300}
    cut = StopFilter(["zz"])
    feed_all(cut, ["a zz b"])
    assert stop_reason("stop", cut, "a zz", words) == "zz"
    free = StopFilter(["zz"])
    assert free.matched is None
    assert stop_reason("stop", free, "xaq", words) == 300
    assert stop_reason("stop", free, "xq", words) == 113
    assert stop_reason("stop", free, "xy", words) is None  # e.g. a template's stop word
    assert stop_reason("length", free, "xq", words) is None
    assert stop_reason("eos", free, "xq", words) is None
    # the last generated id, where it is a stop token, whatever its text (a special one's is
    # empty); another id leaves the text to say
    assert stop_reason("stop", free, "x", words, last_id=300) == 300
    assert stop_reason("stop", free, "xq", words, last_id=7) == 113
    assert stop_reason("eos", free, "x", words, last_id=300) is None


def test_vllm_text_options_become_ensemble_inputs():
    plan = parse_completion({"model": "tiny", "prompt": "x", "stop": ["a"],
                             "stop_token_ids": [ord("q"), 258, ord("q")],
                             "include_stop_str_in_output": True,
                             "bad_words": ["foo", "bar"], "skip_special_tokens": True}, MODELS)
    assert plan.stop_token_ids == [ord("q"), 258] and plan.include_stop
    assert plan.fields["bad_words"] == ["foo", "bar"]
    assert plan.truncate is None
    for keep in (5, -1):  # -1: the context length (the run resolves it)
        cut = parse_completion({"model": "tiny", "prompt": "x", "truncate_prompt_tokens": keep},
                               MODELS)
        assert cut.truncate == keep
    stop_token_texts(plan, byte_tokenizer())
    assert plan.fields["stop_words"] == ["a", "q", "<|im_end|>"]  # the special one by its name
    assert plan.stop_token_words == {"q": ord("q"), "<|im_end|>": 258}
    assert plan.stop == ["a"]  # only the client's strings are cut from the text
    choice = parse_completion({"model": "tiny", "prompt": "x",
                               "guided_choice": ["yes", 'say "no"\n', "yes"]}, MODELS)
    assert choice.fields["guided_decoding_guide_type"] == "ebnf_grammar"
    assert choice.fields["guided_decoding_guide"] == 'root ::= "yes" | "say \\"no\\"\\n"'
    for body, message in (
            ({"stop_token_ids": [-1]}, "'stop_token_ids' must be a list of token ids"),
            ({"stop_token_ids": 5}, "'stop_token_ids' must be a list of token ids"),
            ({"bad_words": [""]}, "'bad_words' must be a list of non-empty strings"),
            ({"spaces_between_special_tokens": "no"},
             "'spaces_between_special_tokens' must be true or false"),
            ({"allowed_token_ids": []}, "'allowed_token_ids' must be a non-empty list"),
            ({"allowed_token_ids": [1, -2]}, "'allowed_token_ids' must be a non-empty list"),
            ({"allowed_token_ids": "12"}, "'allowed_token_ids' must be a non-empty list"),
            # past INT32 the ensemble's tensor would wrap it (2**32 + 7 -> 7; 2**32 - 1 -> -1,
            # the padding value: no restriction at all)
            ({"allowed_token_ids": [3, 2**32 + 7]}, "token id 4294967303 is outside"),
            ({"allowed_token_ids": [2**32 - 1]}, "token id 4294967295 is outside"),
            ({"truncate_prompt_tokens": 0}, "'truncate_prompt_tokens' must be a positive"),
            ({"truncate_prompt_tokens": -2}, "'truncate_prompt_tokens' must be a positive"),
            ({"truncate_prompt_tokens": True}, "'truncate_prompt_tokens' must be a positive"),
            ({"truncate_prompt_tokens": 5, "echo": True}, "cannot be used with 'echo'"),
            ({"guided_choice": []}, "'guided_choice' must be a non-empty list"),
            ({"guided_choice": ["a"], "guided_regex": "a"}, "at most one of")):
        with pytest.raises(RequestError, match=message):
            parse_completion({"model": "tiny", "prompt": "x", **body}, MODELS)
    allowed = parse_completion({"model": "tiny", "prompt": "x",
                                "allowed_token_ids": [5, 3, 5]}, MODELS)
    assert allowed.fields["allowed_token_ids"] == [5, 3]
    far = parse_completion({"model": "tiny", "prompt": "x", "stop_token_ids": [10**6]}, MODELS)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        stop_token_texts(far, byte_tokenizer())
    with pytest.raises(RequestError, match="need the model's tokenizer"):
        stop_token_texts(far, None)


def test_finish_reasons_in_openai_terms():
    assert finish_reason("eos", False) == "stop" and finish_reason("stop", False) == "stop"
    assert finish_reason("length", False) == "length"
    assert finish_reason("length", True) == "stop"  # a stop string cut it
    assert finish_reason("cancelled", False) == "abort"


def test_chat_template_kwargs_reach_the_template():
    thinking = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if enable_thinking is defined and not enable_thinking %}"
                            "<think></think>{% endif %}", SPECIALS)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body, MODELS, thinking).prompts == ["hi"]
    off = parse_chat({**body, "chat_template_kwargs": {"enable_thinking": False,
                                                       "messages": "ignored"}},
                     MODELS, thinking)
    assert off.prompts == ["hi<think></think>"]  # `messages` itself cannot be replaced
    with pytest.raises(RequestError, match="'chat_template_kwargs' must be an object"):
        parse_chat({**body, "chat_template_kwargs": "x"}, MODELS, thinking)


def test_frontend_command_line_errors_are_one_line(tmp_path, capsys):
    """A mistyped --model-repository is refused (it would serve without a tokenizer); a port
    in use is one line on stderr at start, not a traceback after Triton is ready."""
    import socket
    import subprocess
    import sys

    from backend.openai_api.server import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--model-repository", str(tmp_path / "nope")])
    assert info.value.code == 2 and "no such folder" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "backend.openai_api", "--model-repository", str(tmp_path),
             "--triton-url", "127.0.0.1:1", "--wait-s", "1", "--port", str(port)],
            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty",
                                   "repetition_penalty", "length_penalty", "min_p"])
def test_an_integer_past_the_float_range_is_a_400(field):
    """JSON's 1 followed by 400 zeros is a Python int; float() of it overflowed: a 500."""
    huge = 10**400
    for parse, body in ((parse_completion, {"prompt": "x"}),
                        (parse_chat, {"messages": [{"role": "user", "content": "x"}]})):
        args = (MODELS, chatml()) if parse is parse_chat else (MODELS,)
        with pytest.raises(RequestError, match=f"'{field}' must be a number") as info:
            parse({"model": "tiny", **body, field: huge}, *args)
        assert info.value.status == 400
    with pytest.raises(RequestError, match="'logit_bias' value for token 5 must be a number"):
        parse_completion({"model": "tiny", "prompt": "x", "logit_bias": {"5": -huge}}, MODELS)


def test_max_completion_tokens_wins_over_max_tokens():
    """As vLLM and SGLang (OpenAI deprecated max_tokens for it); each is still checked."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat({**body, "max_tokens": 500, "max_completion_tokens": 20}, MODELS,
                      chatml()).max_tokens == 20
    assert parse_chat({**body, "max_tokens": 500}, MODELS, chatml()).max_tokens == 500
    with pytest.raises(RequestError, match="'max_tokens' must be from 1"):
        parse_chat({**body, "max_tokens": 0, "max_completion_tokens": 20}, MODELS, chatml())
