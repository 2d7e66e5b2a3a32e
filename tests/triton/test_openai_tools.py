"""Tool calling in the OpenAI frontend without a server: tools and tool_choice -> the template's
tools and the guides, the chat template against transformers', Qwen's (Hermes) calls read from
text whole and streamed (Hermes JSON, Qwen3-Coder XML, Nemotron's array), the errors for what is
wrong; a thinking model's reasoning split from its answer."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar

from backend.engine.guided import GrammarBackend, Guide
from backend.openai_api.chat import ChatTemplate
from backend.openai_api.protocol import RequestError, parse_chat, response_body, tokenize_body
from backend.openai_api.reasoning import ReasoningReader
from backend.openai_api.tools import (
    NEMOTRON,
    QWEN,
    CallReader,
    ToolPlan,
    parse_tools,
    read_calls,
)
from backend.tokenizer import CHATML_TEMPLATE, byte_tokenizer

MODELS = ("tiny",)
TOKENIZER = byte_tokenizer()
TEMPLATE = ChatTemplate(CHATML_TEMPLATE, TOKENIZER.special_tokens, eos_token="<|endoftext|>")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
KNOWN = {"get_weather": {}, "get_time": {}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def chat(**body) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER, TIME], **body}


def test_the_template_shows_tools_calls_and_results_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=TOKENIZER.tok,
                                              eos_token="<|endoftext|>")
    hf.chat_template = CHATML_TEMPLATE
    # transformers takes the arguments as objects, which is what the frontend passes
    plan = parse_chat(chat(messages=HISTORY), MODELS, TEMPLATE)
    expected = hf.apply_chat_template(
        [{**m, "tool_calls": [{"type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in HISTORY],
        tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    [text] = plan.prompts
    assert text == expected
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in text and text.count("<|im_start|>system") == 1
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n') in text
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>\n" in text
    # without tools the template is plain ChatML, as before tools existed
    plain = parse_chat({"model": "tiny", "messages": HISTORY[:2]}, MODELS, TEMPLATE)
    assert plain.prompts == ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                             "Weather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n"]


def test_tool_choice_sets_the_guide():
    auto = parse_chat(chat(), MODELS, TEMPLATE)
    assert auto.tools.choice == "auto" and "guided_decoding_guide_type" not in auto.fields
    none = parse_chat(chat(tool_choice="none"), MODELS, TEMPLATE)
    assert none.tools.choice == "none" and none.tools.stream() is None
    assert "# Tools" in none.prompts[0]  # still shown, as vLLM does
    named = parse_chat(chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       MODELS, TEMPLATE)
    assert named.fields["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(named.fields["guided_decoding_guide"]) == WEATHER["function"]["parameters"]
    required = parse_chat(chat(tool_choice="required", parallel_tool_calls=False), MODELS,
                          TEMPLATE)
    schema = json.loads(required.fields["guided_decoding_guide"])
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert "maxItems" not in json.loads(parse_chat(chat(tool_choice="required"), MODELS,
                                                   TEMPLATE).fields["guided_decoding_guide"])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_the_guides_compile_and_accept_a_call(choice):
    """XGrammar (the engine's guided decoding) compiles each guide against the model's
    vocabulary and accepts the text of a call, token by token."""
    guide = parse_chat(chat(tool_choice=choice), MODELS, TEMPLATE).tools.guide()
    backend = GrammarBackend(TOKENIZER, TOKENIZER.vocab_size)
    matcher = xgrammar.GrammarMatcher(backend.compile(Guide(*guide)))
    call = {"city": "Paris"}  # json.dumps's separators: the engine's compact JSON
    text = json.dumps([{"name": "get_weather", "parameters": call}] if choice == "required"
                      else call)
    assert all(matcher.accept_token(t) for t in TOKENIZER.encode(text))
    assert matcher.is_terminated() or matcher.accept_token(TOKENIZER.eos_token_id)
    wrong = xgrammar.GrammarMatcher(backend.compile(Guide(*guide)))
    bad = '[{"name":"nope"' if choice == "required" else '{"town"'
    assert not all(wrong.accept_token(t) for t in TOKENIZER.encode(bad))


BAD = [
    (chat(tools="x"), "'tools' must be a list"),
    (chat(tools=[{"type": "retrieval"}]), "only function tools"),
    (chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "1-64 letters"),
    (chat(tools=[{"type": "function", "function": {"name": "f\n"}}]), "1-64 letters"),
    (chat(tools=[WEATHER, WEATHER]), "'get_weather' is given more than once"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "parameters must be a JSON schema object"),
    (chat(tool_choice="sometimes"), "'tool_choice' must be one of"),
    (chat(tool_choice={"type": "function", "function": {"name": "nope"}}),
     "not one of the tools"),
    (chat(tool_choice={"type": "function"}), "tool_choice.function.name must be a string"),
    (chat(tools=None, tool_choice="required"), "'tool_choice' needs 'tools'"),
    (chat(parallel_tool_calls="yes"), "'parallel_tool_calls' must be true or false"),
    (chat(functions=[{"name": "f"}]), "use 'tools' and 'tool_choice'"),
    (chat(tool_choice="required", response_format={"type": "json_object"}),
     "cannot come with response_format"),
    (chat(messages=[{"role": "user", "content": "x", "tool_calls": [{}]}]),
     "only an assistant message has them"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]), "arguments is not valid JSON"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]), "arguments must be a JSON object"),
    (chat(messages=[{"role": "tool", "content": "x", "tool_call_id": 3}]),
     "tool_call_id must be a string"),
]  # fmt: skip


@pytest.mark.parametrize("body, message", BAD)
def test_bad_tool_requests_are_400s_that_say_why(body, message):
    with pytest.raises(RequestError) as info:
        parse_chat(body, MODELS, TEMPLATE)
    assert message in info.value.message and info.value.status == 400


def test_hermes_calls_are_read_from_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = read_calls(text, KNOWN)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2 and calls[0]["id"].startswith("call_")
    # no call, an unknown function, JSON that does not parse, arguments not an object: text
    assert read_calls("just text", KNOWN) is None
    assert read_calls('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', KNOWN) is None
    assert read_calls('<tool_call>\n{"name": "get_time", "argu', KNOWN) is None
    assert read_calls('<tool_call>{"name": "get_time", "arguments": 3}</tool_call>',
                        KNOWN) is None
    # a last call cut before its end tag still counts when its JSON is whole
    _, [call] = read_calls('<tool_call>\n{"name": "get_time", "arguments": {}}\n', KNOWN)
    assert call["function"]["name"] == "get_time"


def _streamed(plan: ToolPlan, text: str, pieces: int):
    return _streamed_in(plan, None, text, pieces)


def _streamed_in(plan: ToolPlan, layout, text: str, pieces: int):
    reader = plan.stream() if layout is None else plan.stream(layout)
    sent, deltas = [], []
    size = max(1, len(text) // pieces)
    for i in range(0, len(text), size):
        out, calls = reader.feed(text[i:i + size])
        sent.append(out)
        deltas += calls
    out, calls = reader.finish()
    return "".join(sent) + out, deltas + calls, reader


def _merged(deltas: list[dict]) -> list[tuple[str, str]]:
    """Streamed deltas -> each call's (name, arguments), as a client joins them."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function"
            calls[d["index"]] = [d["function"]["name"], ""]
        calls[d["index"]][1] += d["function"].get("arguments", "")
    assert list(calls) == list(range(len(calls)))
    return [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("pieces", [1, 3, 200])
@pytest.mark.parametrize("call", [
    '{"name": "get_weather", "arguments": {"city": "Rome"}}',  # Hermes JSON
    "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>",  # XML
])
def test_auto_streams_content_then_each_call(pieces, call):
    plan = parse_tools(chat())
    text = f"Sure.\n\n<tool_call>\n{call}\n</tool_call>"
    content, deltas, reader = _streamed(plan, text, pieces)
    assert content == "Sure." and reader.content == "Sure."
    assert _merged(deltas) == [("get_weather", '{"city": "Rome"}')]
    assert deltas[0]["index"] == 0 and deltas[0]["id"] == reader.calls[0]["id"]
    assert reader.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") \
        == "length"
    # text that only looks like the start of a call is content, sent once it is not one
    content, deltas, reader = _streamed(plan, "a <tool_ b <tool_call", pieces)
    assert content == "a <tool_ b <tool_call" and deltas == [] and reader.calls == []
    assert reader.finish_reason("stop") == "stop"


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "hours": {"type": "array"}, "where": {"type": "object"},
    "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]}}}
# A template that writes assistant calls as Qwen3.5's / Qwen3-Coder's do (XML, one parameter a
# line, objects and lists as JSON, everything else as text)
NL = "{{ '\\n' }}"  # a newline the template's trim_blocks cannot eat
XML_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] or '' }}{% for c in m['tool_calls'] or [] %}"
    + NL + "<tool_call>" + NL + "<function={{ c['function']['name'] }}>" + NL
    + "{% for k, v in c['function']['arguments'].items() %}<parameter={{ k }}>" + NL
    + "{% if v is mapping or (v is iterable and v is not string) %}{{ v | tojson }}"
    "{% else %}{{ v }}{% endif %}" + NL + "</parameter>" + NL + "{% endfor %}</function>" + NL
    + "</tool_call>{% endfor %}{% endfor %}")


def test_qwen3_coder_xml_calls_read_back_what_the_template_wrote():
    """Qwen3.5 / Qwen3-Coder write `<function=NAME>` and one `<parameter=KEY>` per argument,
    values as text: read back, each value is its schema's type again."""
    arguments = {"city": "New York\nand around", "days": 3, "metric": False, "ratio": 0.5,
                 "hours": [9, 17], "where": {"lat": 1.5}, "note": "null", "limit": None}
    template = ChatTemplate(XML_TEMPLATE.replace("{{ v }}", "{{ 'null' if v is none else "
                                                 "(v | lower if v is boolean else v) }}"),
                            TOKENIZER.special_tokens)
    message = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        {"type": "function", "function": {"name": "get_time", "arguments": {}}}]}
    text = template.render([message], add_generation_prompt=False)
    assert "<parameter=days>\n3\n</parameter>" in text
    known = {"get_weather": SCHEMA, "get_time": {}}
    content, calls = read_calls(text, known)
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {**arguments, "note": "null"}), ("get_time", {})]
    # a string-typed "null" stays text; a nullable integer's null is None (checked above);
    # values that do not convert stay text; a parameter the schema does not name is text
    _, [call] = read_calls("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n"
                           "</parameter>\n<parameter=extra>\n{\"a\": 1}\n</parameter>\n"
                           "<parameter=metric>\nyes\n</parameter>\n</function>\n</tool_call>",
                           known)
    assert json.loads(call["function"]["arguments"]) == {"days": "three", "extra": '{"a": 1}',
                                                         "metric": "yes"}
    # an unknown function: the text is content; a call cut before </function> (max_tokens)
    # is a call with the arguments read so far
    assert read_calls("<tool_call>\n<function=rm>\n</function>\n</tool_call>", known) is None
    _, [cut] = read_calls("<tool_call>\n<function=get_time>\n<parameter=zone>\nUT", known)
    assert cut["function"] == {"name": "get_time", "arguments": '{"zone": "UT"}'}
    # Hermes JSON and XML blocks may both come in one answer
    _, calls = read_calls('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                          "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", known)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_time"]


@pytest.mark.parametrize("pieces", [1, 5, 300])
def test_nemotron_calls_are_one_array_in_toolcall_tags(pieces):
    plan = parse_tools(chat())
    text = ('Two lookups. <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]</TOOLCALL>')
    content, deltas, reader = _streamed_in(plan, NEMOTRON, text, pieces)
    assert content == "Two lookups." and _merged(deltas) == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert reader.finish_reason("stop") == "tool_calls"
    # without parallel calls the first; a first item not a call: all content; a later item
    # not one: dropped (the calls before it went out)
    one = parse_tools(chat(parallel_tool_calls=False))
    assert _merged(_streamed_in(one, NEMOTRON, text, pieces)[1]) == [
        ("get_weather", '{"city": "Oslo"}')]
    for bad in ('<TOOLCALL>[{"name": "rm", "arguments": {}}]</TOOLCALL>',
                '<TOOLCALL>[3, {"name": "get_time", "arguments": {}}]</TOOLCALL>',
                '<TOOLCALL>[{"arguments": {}, "name": "get_time"}, 3]</TOOLCALL>',
                '<TOOLCALL>[{"name": "get_time", "argu'):
        content, deltas, _ = _streamed_in(plan, NEMOTRON, bad, pieces)
        assert content == bad and deltas == []
    later = '<TOOLCALL>[{"name": "get_time", "arguments": {}}, 3, {"name": "get_time"}]'
    content, deltas, _ = _streamed_in(plan, NEMOTRON, later, pieces)
    assert (content, _merged(deltas)) == ("", [("get_time", "{}")])
    # written another way (arguments first, or as a JSON string): read whole as it closes
    other = ('<TOOLCALL>[{"arguments": {"city": "Oslo"}, "name": "get_weather"}, '
             '{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]</TOOLCALL>')
    assert _merged(_streamed_in(plan, NEMOTRON, other, pieces)[1]) == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')]
    # Qwen's tags mean nothing in Nemotron's layout, and the other way round
    qwen = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _streamed_in(plan, NEMOTRON, qwen, pieces)[:2] == (qwen, [])
    assert _streamed(plan, text, pieces)[:2] == (text, [])


def test_a_call_goes_as_soon_as_its_function_is_known_then_its_arguments():
    """Streamed, a call's id and name go when its arguments' object opens, its arguments as
    they come, before its end tag; a later block that is not a call is dropped (whole or
    streamed), a first one makes all text."""
    first = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    second = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    bad = '\n<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'
    reader = parse_tools(chat()).stream()
    head = first.index("{}") + 1
    assert reader.feed("Ok. " + first[:head - 1]) == ("Ok.", [])
    _, [delta] = reader.feed(first[head - 1])
    assert delta == {"index": 0, "id": reader.calls[0]["id"], "type": "function",
                     "function": {"name": "get_time", "arguments": "{"}}
    opened = second.index('{"city') + 1
    assert reader.feed(first[head:] + second[:opened])[1] == [
        {"index": 0, "function": {"arguments": "}"}},
        {"index": 1, "id": reader.calls[1]["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": "{"}}]
    assert reader.feed(second[opened:opened + 5])[1] == [
        {"index": 1, "function": {"arguments": '"city'}}]
    assert reader.feed(second[opened + 5:] + bad)[1] == [
        {"index": 1, "function": {"arguments": '": "Oslo"}'}}]
    assert reader.finish() == ("", []) and len(reader.calls) == 2
    assert [c["function"]["name"] for c in read_calls(first + bad + second, KNOWN)[1]] == [
        "get_time", "get_weather"]
    assert read_calls(bad + first, KNOWN) is None
    text = "So:" + bad + second
    assert _streamed(parse_tools(chat()), text, 4)[:2] == (text, [])


def test_a_call_begun_stays_a_call():
    """Once its function is known a call has gone out: cut by max_tokens it keeps the
    arguments read so far; with arguments that are not JSON, those (OpenAI: arguments may be
    invalid JSON); read whole, the same."""
    for text, arguments in (
            ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro', '{"city": "Ro'),
            ('<tool_call>\n{"name": "get_weather", "arguments": {"days": 1', '{"days": 1'),
            ('<tool_call>{"name": "get_weather", "arguments": {"city": Rome}}</tool_call>',
             '{"city": Rome}')):
        for pieces in (1, 4, 100):
            content, deltas, reader = _streamed(parse_tools(chat()), text, pieces)
            assert (content, _merged(deltas)) == ("", [("get_weather", arguments)])
        assert read_calls(text, KNOWN)[1][0]["function"]["arguments"] == arguments


def test_required_streams_each_calls_arguments():
    required = parse_tools(chat(tool_choice="required"))
    tricky = {"city": 'a "quoted" } ] { [ \\ city'}  # brackets and escapes inside strings
    text = json.dumps([{"name": "get_weather", "parameters": tricky},
                       {"name": "get_time", "parameters": {}}])
    reader = required.stream()
    opened = text.index('"parameters": {') + len('"parameters": ')
    assert reader.feed(text[:opened]) == ("", [])
    _, [delta] = reader.feed(text[opened:opened + 5])
    assert delta["function"] == {"name": "get_weather", "arguments": '{"cit'}
    for pieces in (1, 3, 500):
        content, deltas, reader = _streamed(required, text, pieces)
        assert content == "" and _merged(deltas) == [
            ("get_weather", json.dumps(tricky)), ("get_time", "{}")]
    # cut by max_tokens inside the second call: both, the second as far as it came; without
    # parallel calls one
    cut = text.index("get_time") + len('get_time", "parameters": {')
    content, deltas, reader = _streamed(required, text[:cut], 3)
    assert content == "" and _merged(deltas) == [
        ("get_weather", json.dumps(tricky)), ("get_time", "{")]
    assert reader.finish_reason("length") == "length"
    one = parse_tools(chat(tool_choice="required", parallel_tool_calls=False))
    assert len(_merged(_streamed(one, text, 2)[1])) == 1


def test_named_calls_stream_their_arguments_and_required_reads_the_array():
    named = parse_tools(chat(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    content, deltas, reader = _streamed(named, '{"zone":"UTC"}', 5)
    assert content == "" and reader.content is None
    assert deltas[0] == {"index": 0, "id": reader.calls[0]["id"], "type": "function",
                         "function": {"name": "get_time", "arguments": '{"'}}
    assert all(d.keys() == {"index", "function"} for d in deltas[1:])
    assert reader.calls[0]["function"]["arguments"] == '{"zone":"UTC"}'
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"zone":"UTC"}'
    assert reader.finish_reason("stop") == "stop"  # as OpenAI's for a named function
    required = parse_tools(chat(tool_choice="required"))
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                       {"name": "get_time", "parameters": {}}])
    content, deltas, reader = _streamed(required, text, 4)
    assert content == "" and _merged(deltas) == [("get_weather", '{"city": "Oslo"}'),
                                                 ("get_time", "{}")]
    assert reader.finish_reason("stop") == "tool_calls"
    # cut by max_tokens: no call, the text is the content
    content, deltas, reader = _streamed(required, text[:20], 2)
    assert content == text[:20] and deltas == [] and reader.finish_reason("length") == "length"


def test_a_message_with_calls_has_null_content():
    plan = parse_chat(chat(), MODELS, TEMPLATE)
    _, [call] = read_calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
                             KNOWN)
    body = response_body(plan, [None, "hi"], ["tool_calls", "stop"], {}, calls=[[call], []])
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert second["message"] == {"role": "assistant", "content": "hi"}


def test_tokenize_renders_tools_as_the_chat_does():
    body = chat(messages=HISTORY)
    rendered = tokenize_body(body, MODELS, TOKENIZER, TEMPLATE, 2048)
    assert rendered["tokens"] == TOKENIZER.encode(parse_chat(body, MODELS, TEMPLATE).prompts[0],
                                                  add_special_tokens=False)


def _split(reader: ReasoningReader, text: str, size: int) -> tuple[str, str]:
    reasoning = content = ""
    for i in range(0, len(text), size):
        r, c = reader.feed(text[i:i + size])
        reasoning, content = reasoning + r, content + c
    r, c = reader.finish()
    return reasoning + r, content + c


CASES = [  # (prompt's end, output) -> (reasoning, content)
    ("<|im_start|>assistant\n", "<think>\nplan</think>\n\nanswer", ("\nplan", "answer")),
    ("<|im_start|>assistant\n", "\n<think>a</think>b\n", ("a", "b\n")),
    ("<|im_start|>assistant\n<think>\n", "plan</think>\n\nanswer", ("plan", "answer")),
    ("<|im_start|>assistant\n<think>\n", "plan cut by max_tok", ("plan cut by max_tok", "")),
    ("<|im_start|>assistant\n", "no thinking </think> here", ("", "no thinking </think> here")),
    ("<|im_start|>assistant\n", "<thin or <think not a tag", ("", "<thin or <think not a tag")),
    ("<|im_start|>assistant\n", "<think>open, cut </thi", ("open, cut </thi", "")),
    ("<|im_start|>assistant\n", "<think>a</thinker>b</think>", ("a</thinker>b", "")),
    ("<|im_start|>assistant\n", "", ("", "")),
]


@pytest.mark.parametrize("prompt, output, expected", CASES)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_reasoning_is_split_from_the_answer_however_the_text_streams(prompt, output, expected,
                                                                      size):
    reader = ReasoningReader.for_prompt(prompt)
    assert _split(reader, output, size) == expected
    assert reader.reasoning == (expected[0] or None)


CALL_CASES = [  # output after a prompt that opened <think> -> (reasoning, content)
    ("plan<tool_call>\n{}\n</tool_call>", ("plan", "<tool_call>\n{}\n</tool_call>")),
    ("plan</think>\n\n<tool_call>x", ("plan", "<tool_call>x")),
    ("a <tool_ b <tool_cal", ("a <tool_ b <tool_cal", "")),
    ("plan</think>ok", ("plan", "ok")),
]


@pytest.mark.parametrize("output, expected", CALL_CASES)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_tool_call_ends_the_thinking(output, expected, size):
    """With tools (qwen3 parser), `<tool_call>` inside the thinking ends it, as `</think>`
    does (vLLM's Qwen3 parser); without tools it is reasoning like any text."""
    prompt = "<|im_start|>assistant\n<think>\n"
    assert _split(ReasoningReader.for_prompt(prompt, "<tool_call>"), output, size) == expected
    plain = _split(ReasoningReader.for_prompt(prompt), output, size)
    assert plain == (expected if "</think>" in output else (output, ""))


def test_auto_keeps_one_call_without_parallel_calls():
    text = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    for parallel, names in ((True, ["get_time", "get_weather"]), (False, ["get_time"])):
        _, deltas, reader = _streamed(parse_tools(chat(parallel_tool_calls=parallel)), text, 7)
        assert [c["function"]["name"] for c in reader.calls] == names
        assert [name for name, _ in _merged(deltas)] == names


def test_an_earlier_steps_reasoning_reaches_the_template():
    """Qwen3's templates show `reasoning_content` of the assistant turns after the last user
    message (a tool-calling turn's thinking); the frontend passes it on."""
    template = ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}:{% if m['reasoning_content'] %}<think>"
        "{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}|{% endfor %}",
        TOKENIZER.special_tokens)
    messages = [{"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
                 "tool_calls": [{"type": "function", "function": {"name": "get_time",
                                                                  "arguments": "{}"}}]},
                {"role": "tool", "content": "12:00"}]
    plan = parse_chat(chat(messages=messages), MODELS, template)
    assert plan.prompts == ["user:Time?|assistant:<think>ask the tool</think>|tool:12:00|"]
    with pytest.raises(RequestError, match="reasoning_content must be a string"):
        parse_chat(chat(messages=[{"role": "assistant", "content": "", "reasoning": 3}]),
                   MODELS, template)


def test_xml_values_take_the_types_of_unions_enums_and_consts():
    """A parameter typed by `anyOf` / `oneOf` (a nullable integer as pydantic writes it),
    `enum` or `const` converts as its members' types say; a union with string stays text."""
    schema = {"type": "object", "properties": {
        "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "level": {"enum": [1, 2, 3]}, "mode": {"enum": ["fast", "slow"]},
        "on": {"const": True}, "spec": {"oneOf": [{"type": "object"}, {"type": "array"}]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "open": {"anyOf": [{"type": "integer"}, {}]}}}
    params = {"n": "7", "level": "2", "mode": "fast", "on": "true", "spec": "[1, 2]",
              "either": "5", "open": "5"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    _, [call] = read_calls(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>",
                           {"f": schema})
    assert json.loads(call["function"]["arguments"]) == {
        "n": 7, "level": 2, "mode": "fast", "on": True, "spec": [1, 2], "either": "5",
        "open": "5"}
    _, [call] = read_calls("<tool_call>\n<function=f>\n<parameter=n>\nnull\n</parameter>\n"
                           "</function>\n</tool_call>", {"f": schema})
    assert json.loads(call["function"]["arguments"]) == {"n": None}


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value: nested objects and arrays, strings with quotes, escapes, control
    characters, non-ASCII and astral characters, numbers in several spellings' values."""
    kind = rng.choice(["str", "int", "float", "lit", "obj", "arr"] if depth < 3 else
                      ["str", "int", "float", "lit"])
    if kind == "str":
        return "".join(rng.choice(['a', ' ', '"', '\\', '/', '\n', '\t', '\x01', 'é', '€',
                                   '😀', '}', ']', ',', ':']) for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.choice([0, -1, 7, 10 ** 20])
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-7, 3.0, 1e300])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "obj":
        return {"k" + str(i) + rng.choice(["", '"', "é"]): _value(rng, depth + 1)
                for i in range(rng.randint(0, 3))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) \
        if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_arguments_are_rewritten_as_json_dumps_writes_them_however_they_stream():
    """JsonCanon: any JSON object, written compact, indented, ASCII-escaped (surrogate pairs)
    or with odd spacing, cut anywhere, comes out as json.dumps(json.loads(text))."""
    from backend.openai_api.call_scan import JsonCanon
    rng = random.Random(7)
    for _ in range(400):
        value = {"a": _value(rng)}
        text = rng.choice([
            json.dumps(value), json.dumps(value, separators=(",", ":")),
            json.dumps(value, indent=2), json.dumps(value, ensure_ascii=False),
            json.dumps(value, separators=(" ,\t", " :\n "))])
        canon, out, end = JsonCanon(), "", None
        pieces = _pieces(rng, text + " tail")
        rest = None  # the text after the value
        for i, piece in enumerate(pieces):
            got, end = canon.feed(piece)
            out += got
            if end is not None:
                rest = piece[end:] + "".join(pieces[i + 1:])
                break
        assert out == json.dumps(value, ensure_ascii=False) and rest == " tail"
    # literals and numbers as Python writes them; an escape split anywhere
    text = '{"x":1.50E1,"y":-0,"z":"\\u00e9\\ud83d\\ude00\\/\\ud83d"}'
    expected = '{"x": 15.0, "y": 0, "z": "é😀/\\ud83d"}'  # a lone surrogate stays escaped
    assert JsonCanon().feed(text) == (expected, len(text))
    canon = JsonCanon()
    assert "".join(canon.feed(ch)[0] for ch in text) == expected and canon.done


def _answer(rng: random.Random, layout) -> str:
    """Random text in a layout: content, calls of known and unknown functions in each
    form, text between blocks, and junk that only looks like calls."""
    def call() -> str:
        name = rng.choice(["get_weather", "get_time", "rm"])
        arguments = {"city": _value(rng)} if rng.random() < 0.8 else _value(rng)
        form = rng.choice(["hermes", "hermes", "swapped", "string", "xml"])
        if form == "xml" and not layout.array:
            params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in (
                arguments.items() if isinstance(arguments, dict) else []))
            return f"<function={name}>\n{params}</function>"
        if form == "swapped":
            return json.dumps({"arguments": arguments, "name": name})
        if form == "string":
            return json.dumps({"name": name, "arguments": json.dumps(arguments)})
        return json.dumps({"name": name, "arguments": arguments},
                          indent=rng.choice([None, 1]))
    parts = [rng.choice(["", "Let me check. ", "a <tool_ b ", "x"])]
    for _ in range(rng.randint(0, 3)):
        body = (("[" + ", ".join(call() for _ in range(rng.randint(0, 3))) + "]")
                if layout.array else rng.choice([call(), call(), "not a call"]))
        after = rng.choice(["", "\n", " x "])
        parts.append(f"{layout.start}\n{body}\n{layout.end}{after}")
    return "".join(parts)


@pytest.mark.parametrize("layout", [QWEN, NEMOTRON], ids=["qwen", "nemotron"])
def test_streamed_calls_are_the_whole_texts_calls_at_every_cut(layout):
    """Whatever the pieces, and wherever max_tokens cuts the text, the streamed content and
    calls (joined from their deltas) are what reading the whole text gives."""
    rng = random.Random(11)
    plan = parse_tools(chat())
    known = plan.schemas
    for _ in range(120):
        text = _answer(rng, layout)
        for cut in sorted({len(text), *rng.sample(range(len(text) + 1), min(6, len(text)))}):
            prefix = text[:cut]
            whole = read_calls(prefix, known, layout)
            reader = plan.stream(layout)
            content, deltas = "", []
            for piece in _pieces(rng, prefix):
                out, more = reader.feed(piece)
                content, deltas = content + out, deltas + more
            out, more = reader.finish()
            content, deltas = content + out, deltas + more
            if whole is None:
                assert (content, deltas) == (prefix, [])
            else:
                assert content == whole[0]
                assert _merged(deltas) == [(c["function"]["name"], c["function"]["arguments"])
                                           for c in whole[1]]
                assert [(c["function"]["name"], c["function"]["arguments"])
                        for c in reader.calls] == _merged(deltas)


def _xml_parameter(rng: random.Random, key: str) -> str:
    """One parameter as a Qwen3-Coder template might write it: a value of its schema's type
    (or text that does not convert), newlines around it or not, its end tag or not."""
    value = rng.choice([
        "".join(rng.choice(["a", " ", "\n", "<", ">", '"', "é", "/", "param", "</para"])
                for _ in range(rng.randint(0, 12))),
        str(rng.choice([0, -3, 17])), rng.choice(["true", "False", "null"]), "2.5",
        json.dumps(_value(rng)), "not a number"])
    before, after = rng.choice(["\n", "", "\n\n"]), rng.choice(["\n", "", "\n\n"])
    end = rng.choice(["</parameter>", "</parameter>\n", ""])
    return f"<parameter={key}>{before}{value}{after}{end}"


def test_xml_calls_stream_to_what_the_pattern_reads_whole():
    """Qwen3-Coder XML streamed (text-typed values character by character, the others as they
    close) joins to what the regular expressions read from the whole block (the reader of a
    block that did not stream), values converted by their schema's types, for any pieces."""
    rng = random.Random(3)
    known = {"get_weather": SCHEMA, "get_time": {}}
    plan = ToolPlan([{"type": "function", "function": {"name": n, "parameters": s}}
                     for n, s in known.items()], "auto")
    for _ in range(300):
        keys = rng.sample([*SCHEMA["properties"], "extra"], rng.randint(0, 4))
        body = "<function=get_weather>\n" + "".join(_xml_parameter(rng, k) for k in keys)
        body += rng.choice(["</function>", "\n</function>", ""])
        text = f"<tool_call>\n{body}\n</tool_call>"
        expected = CallReader(known)._whole(body.strip())
        if expected is None:  # the pattern wants </function>; the streamed read does not
            continue
        for pieces in (1, 3, rng.randint(4, 40)):
            reader = plan.stream()
            deltas = []
            size = max(1, len(text) // pieces)
            for i in range(0, len(text), size):
                deltas += reader.feed(text[i:i + size])[1]
            deltas += reader.finish()[1]
            assert _merged(deltas) == expected, (text, pieces)


def test_a_text_parameter_streams_as_it_is_written():
    reader = parse_tools(chat()).stream()
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    assert [d["function"] for d in reader.feed(head)[1]] == [
        {"name": "get_weather", "arguments": '{"city": "'}]
    sent = []
    for ch in "New\nYork\n":
        sent += [d["function"]["arguments"] for d in reader.feed(ch)[1]]
    # a newline waits for what follows it (it is left out where the value ends there)
    assert sent == ["N", "e", "w", "\\nY", "o", "r", "k"]
    tail = [d["function"]["arguments"] for d in reader.feed("</parameter>\n</function>\n"
                                                            "</tool_call>")[1]]
    assert "".join(tail) == '"}' and reader.calls[0]["function"]["arguments"] == \
        '{"city": "New\\nYork"}'


@pytest.mark.parametrize("pieces", [1, 7, 200])
def test_an_end_tag_inside_a_string_argument_does_not_end_the_call(pieces):
    """A call whose argument quotes the layout's end tag (a file about tool calls): the call
    ends at the tag outside its JSON strings, whole and streamed (before, it was cut at the
    quoted tag, its arguments left as broken JSON)."""
    arguments = {"content": "Qwen ends calls with </tool_call> tags", "note": 'a "q" </tool_call>'}
    text = ('<tool_call>\n{"name": "get_weather", "arguments": '
            + json.dumps(arguments) + '}\n</tool_call>')
    _, [call] = read_calls(text, KNOWN)
    assert json.loads(call["function"]["arguments"]) == arguments
    content, deltas, reader = _streamed(parse_tools(chat()), text, pieces)
    assert content == "" and [(n, json.loads(a)) for n, a in _merged(deltas)] == [
        ("get_weather", arguments)]
    assert reader.finish_reason("stop") == "tool_calls"
    # an XML call has no JSON strings: its first end tag ends it, quotes or not
    xml = '<tool_call>\n<function=get_weather>\n<parameter=city>\n"Rome\n</parameter>\n' \
          '</function>\n</tool_call> "tail'
    _, [call] = read_calls(xml, KNOWN)
    assert json.loads(call["function"]["arguments"]) == {"city": '"Rome'}


def test_required_over_an_empty_tool_list_means_none():
    """As vLLM: tool_choice "required" or "auto" with tools [] is no tools; without a tools
    list it stays a 400."""
    assert parse_tools(chat(tools=[], tool_choice="required")) is None
    assert parse_tools(chat(tools=[], tool_choice="auto")) is None
    with pytest.raises(RequestError, match="'tool_choice' needs 'tools'"):
        parse_tools(chat(tools=None, tool_choice="auto"))
    with pytest.raises(RequestError, match="'tool_choice' needs 'tools'"):
        parse_tools(chat(tools=None, tool_choice="required"))


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"anyOf": 5}}},
    {"type": "object", "properties": {"x": {"type": {"x": 1}}}},
    {"type": "object", "properties": {"x": {"type": ["string", ["null"]]}}},
    {"type": "object", "properties": {"x": {"oneOf": [{"type": {}}]}}},
    {"type": "object", "properties": "x"},
])
def test_odd_parameter_schemas_do_not_break_the_xml_reader(schema):
    """A parameters schema is any JSON object: one the reader cannot read types from gives
    text values (it raised TypeError / AttributeError mid-stream: a 500 or a cut stream)."""
    known = {"f": schema}
    xml = "<tool_call>\n<function=f>\n<parameter=x>\n5\n</parameter>\n</function>\n</tool_call>"
    _, [call] = read_calls(xml, known)
    assert json.loads(call["function"]["arguments"]) == {"x": "5"}
    reader = CallReader(known)  # streamed, a character at a time
    events = []
    for ch in xml:
        events += reader.feed(ch)[1]
    events += reader.finish()[1]
    assert events[0] == ("call", "f")
    assert "".join(text for kind, text in events if kind == "args") == '{"x": "5"}'


def _strict(text: str):
    def refuse(name):
        raise ValueError(name)
    return json.loads(text, parse_constant=refuse)


def test_arguments_stay_json_where_a_number_does_not_fit_a_float():
    """1e400 is a JSON number Python reads as inf, which json.dumps wrote as `Infinity` (no
    JSON parser takes it); an XML value `nan` / `inf` became NaN / Infinity the same way.
    Now a streamed number keeps its text, an XML one that is no finite number stays text,
    and a call read whole with one is not read as a call."""
    known = {"f": {"type": "object", "properties": {"x": {"type": "number"}}}}
    streamed = '<tool_call>\n{"name": "f", "arguments": {"x": 1e400}}\n</tool_call>'
    _, [call] = read_calls(streamed, known)
    assert call["function"]["arguments"] == '{"x": 1e400}'
    for word in ("1e400", "nan", "inf", "-Infinity"):
        xml = f"<tool_call>\n<function=f>\n<parameter=x>\n{word}\n</parameter>\n" \
              "</function>\n</tool_call>"
        _, [call] = read_calls(xml, known)
        assert _strict(call["function"]["arguments"]) == {"x": word}
    xml = xml.replace("-Infinity", "2.5")
    assert _strict(read_calls(xml, known)[1][0]["function"]["arguments"]) == {"x": 2.5}
    swapped = '<tool_call>\n{"arguments": {"x": 1e400}, "name": "f"}\n</tool_call>'
    assert read_calls(swapped, known) is None
    for text in (swapped.replace("1e400", "NaN"), swapped.replace("1e400", "3")):
        found = read_calls(text, known)
        assert found is None if "NaN" in text else \
            _strict(found[1][0]["function"]["arguments"]) == {"x": 3}
