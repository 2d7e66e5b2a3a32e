"""The Responses API without a server: requests -> chat bodies (input items, instructions, the
stored conversation, tools, text formats), the errors for what is wrong, the stored responses,
and the output items and stream events built from a chat run's pieces."""

from __future__ import annotations

import pytest

from backend.openai_api.errors import RequestError
from backend.openai_api.protocol import parse_chat
from backend.openai_api.responses import (
    ResponseBuilder,
    ResponseStore,
    Stored,
    input_messages,
    parse,
    to_chat,
)
from tests.triton.test_openai_tools import MODELS, TEMPLATE

TOOL = {"type": "function", "name": "get_time", "description": "The time",
        "parameters": {"type": "object", "properties": {}}}
USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
         "prompt_tokens_details": {"cached_tokens": 0}}


def test_input_items_become_chat_messages():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                          {"type": "input_text", "text": "brief."}]},
        {"type": "message", "role": "user", "content": "Time?"},
        {"type": "reasoning", "id": "rs_0", "summary": []},  # nothing to carry
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "once more"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"},
    ]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool",
                                             "assistant"]
    assert messages[0]["content"] == "Be \nbrief."  # parts joined by "\n", as chat's
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[2]["content"] == "Checking."
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
    assert messages[4]["content"] is None and messages[4]["tool_calls"][0]["id"] == "call_3"
    assert messages[4]["reasoning_content"] == "once more"  # the step's thinking, for the template
    assert "reasoning_content" not in messages[2]
    # what the chat path makes of them: a valid chat, the calls rendered for the template
    plan = parse_chat({"model": "tiny", "messages": messages, "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}, MODELS, TEMPLATE)
    assert plan.prompts[0].count('<tool_call>\n{"name": "get_time", "arguments": {}}') == 3


def test_a_request_becomes_a_chat_body_with_the_stored_conversation():
    store = ResponseStore()
    store.put("resp_1", Stored([{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello"}], {}))
    conv = to_chat({"model": "tiny", "input": "Time?", "instructions": "Be brief.",
                    "previous_response_id": "resp_1", "max_output_tokens": 7, "top_k": 1,
                    "temperature": 0.5, "tools": [TOOL],
                    "tool_choice": {"type": "function", "name": "get_time"},
                    "text": {"format": {"type": "json_schema", "name": "t",
                                        "schema": {"type": "object"}}},
                    "metadata": {"k": "v"}, "store": False, "stream": True}, store)
    chat = conv.chat
    assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello"},
                                {"role": "user", "content": "Time?"}]
    assert conv.history == chat["messages"][1:]  # the instructions are not carried on
    assert (chat["max_tokens"], chat["top_k"], chat["temperature"]) == (7, 1, 0.5)
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_time", "description": "The time", "parameters": TOOL["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "object"}}}
    assert "input" not in chat and "metadata" not in chat and "stream" not in chat
    assert (conv.store, conv.stream, conv.echo["metadata"]) == (False, True, {"k": "v"})
    assert conv.echo["tools"] == [TOOL] and conv.echo["previous_response_id"] == "resp_1"
    # the stored conversation is copied, not shared with the new request
    chat["messages"][1]["content"] = "changed"
    assert store.get("resp_1").messages[0]["content"] == "Hi"


BAD = [
    ({"input": []}, 400, "'input' must be a string or a non-empty list"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "'item_reference' are not"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, 400,
     "only text parts"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "role must be user, system"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "call_id must be a string"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "'resp_nope' not found"),
    ({"input": "x", "previous_response_id": 7}, 400, "'previous_response_id' must be a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, 400,
     "input[0].output must be a string or a list of text parts"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "only function tools"),
    ({"input": "x", "background": True}, 400, "'background'"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"input": "x", "store": "yes"}, 400, "'store' must be true or false"),
    ({"input": "x", "instructions": 3}, 400, "'instructions' must be a string"),
    ({"input": "x", "truncation": "auto"}, 400, "'truncation' must be 'disabled'"),
    ({"input": "x", "top_logprobs": 2}, 400, "'top_logprobs' is not supported"),
]  # fmt: skip


@pytest.mark.parametrize("body, status, message", BAD)
def test_bad_requests_say_what_is_wrong(body, status, message):
    with pytest.raises(RequestError) as info:
        to_chat({"model": "tiny", **body}, ResponseStore())
    assert message in info.value.message and info.value.status == status


@pytest.mark.parametrize("body, param, message", [
    ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be"),
    ({"max_output_tokens": "7"}, "max_output_tokens", "'max_output_tokens' must be"),
    ({"text": "oops"}, "text", "'text' must be an object"),
    ({"text": {"format": {"type": "json_schema", "name": "t", "schema": "x"}}}, "text.format",
     "text.format.schema must be an object"),
])  # fmt: skip
def test_errors_of_the_chat_path_name_the_responses_fields(body, param, message):
    """A value the chat path refuses is named as the client sent it (max_output_tokens, not
    the chat's max_tokens); a `text` that is not an object is refused, not ignored."""
    with pytest.raises(RequestError) as info:
        parse({"model": "tiny", "input": "Hi", **body}, ResponseStore(), MODELS, TEMPLATE)
    error = info.value
    assert (error.status, error.param) == (400, param) and message in error.message, error.message
    assert "max_tokens" not in error.message and "response_format" not in error.message


def test_the_store_keeps_the_last_responses():
    store = ResponseStore(size=2)
    for rid in ("a", "b"):
        store.put(rid, Stored([], {"id": rid}))
    store.get("a")  # used: "b" is now the oldest
    store.put("c", Stored([], {"id": "c"}))
    assert store.get("b") is None and store.get("a").body == {"id": "a"}
    assert store.delete("a") and not store.delete("a")


def test_pieces_become_output_items_and_events_in_order():
    conv = to_chat({"model": "tiny", "input": "x", "tools": [TOOL]}, ResponseStore())
    builder = ResponseBuilder(conv, "tiny")
    events = builder.start()
    events += builder.feed("think", "", [])
    events += builder.feed("ing", "Let me ", [])
    events += builder.feed("", "check.", [])
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": "{}"}}
    events += builder.feed("", "", [call])
    events += builder.finish("stop", USAGE, reasoning_tokens=2)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    body = builder.body
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert body["output"][1]["content"][0]["text"] == "Let me check."
    assert body["output"][2] | {"id": None} == {"type": "function_call", "id": None,
                                                "call_id": "call_1", "name": "get_time",
                                                "arguments": "{}", "status": "completed"}
    assert all(i["status"] == "completed" for i in body["output"])
    assert body["status"] == "completed" and body["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 2}
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == "response.completed" and events[-1]["response"] == body
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Let me check."
    # each item is added before its deltas and done once, in output order
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [0, 1, 2]
    assert builder.answer() == {"role": "assistant", "content": "Let me check.",
                                "reasoning_content": "thinking", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]}


def test_a_cut_answer_is_incomplete_and_an_empty_one_still_has_a_message():
    """max_output_tokens: the response and the item it cut are incomplete."""
    builder = ResponseBuilder(to_chat({"model": "tiny", "input": "x"}, ResponseStore()), "t")
    events = builder.start() + builder.finish("length", USAGE)
    assert builder.body["status"] == "incomplete"
    assert builder.body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"
    [message] = builder.body["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == ""
    assert message["status"] == "incomplete"  # the item the cut ended, as OpenAI's
    # A thought closed before the answer began stays completed; the answer it cut does not.
    cut = ResponseBuilder(to_chat({"model": "tiny", "input": "x"}, ResponseStore()), "t")
    events = cut.start() + cut.feed("hmm", "", []) + cut.feed("", "The ans", [])
    events += cut.finish("length", USAGE)
    assert [(i["type"], i["status"]) for i in cut.body["output"]] == [
        ("reasoning", "completed"), ("message", "incomplete")]
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["completed", "incomplete"]
    whole = ResponseBuilder(to_chat({"model": "tiny", "input": "x"}, ResponseStore()), "t")
    whole.start()
    whole.feed("", "Done.", [])
    whole.finish("stop", USAGE)
    assert [i["status"] for i in whole.body["output"]] == ["completed"]


@pytest.mark.parametrize("extra, pieces, reason, status", [
    ({"max_output_tokens": 5}, ["", '{"zone": "U'], "length", "incomplete"),
    ({}, ['{"zone": UTC}'], "tool_calls", "completed")], ids=["cut", "not_json"])
def test_a_call_whose_arguments_are_no_json_object_does_not_break_the_next_response(
        extra, pieces, reason, status):
    """The answer a response stores leaves out a function call whose arguments are no JSON
    object: one max_output_tokens cut (incomplete) or one the model closed so ({"zone":
    UTC}), so a follow-up through previous_response_id renders; the response itself still
    shows the call as written. (Before, every follow-up was a 400 about a 'messages[1]' the
    client never sent.)"""
    store = ResponseStore()
    conv = to_chat({"model": "tiny", "input": "hi", "tools": [TOOL], **extra}, store)
    builder = ResponseBuilder(conv, "tiny")
    builder.start()
    builder.feed("", "", [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "get_time", "arguments": pieces[0]}}])
    for piece in pieces[1:]:
        builder.feed("", "", [{"index": 0, "function": {"arguments": piece}}])
    builder.finish(reason, USAGE)
    [call] = builder.body["output"]
    assert call["type"] == "function_call" and call["status"] == status
    assert call["arguments"] == "".join(pieces)
    assert "tool_calls" not in builder.answer()
    store.put(conv.id, Stored(conv.history + [builder.answer()], builder.body))
    for follow_input in ("try again", [{"type": "function_call_output", "call_id": "call_1",
                                        "output": "12:00"}]):
        follow = to_chat({"model": "tiny", "previous_response_id": conv.id, "tools": [TOOL],
                          "input": follow_input}, store)
        [prompt] = parse_chat(follow.chat, MODELS, TEMPLATE).prompts
        if follow_input == "try again":
            assert prompt.endswith("try again<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("tools", [None, []])
def test_tool_choice_auto_without_tools_is_the_responses_default(tools):
    """"auto" is the Responses API's default tool_choice: sent without tools it was a 400."""
    body = {"model": "tiny", "input": "hi", "tool_choice": "auto"}
    if tools is not None:
        body["tools"] = tools
    conv = to_chat(body, ResponseStore())
    assert parse_chat(conv.chat, MODELS, TEMPLATE).tools is None
