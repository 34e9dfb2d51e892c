"""Tool calls parsed from the model's text (Qwen2.5's `<tool_call>` blocks) into OpenAI's shape."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem_inference.gateway.outputs import Output
from tandem_inference.gateway.responses import ResponseFormat
from tandem_inference.gateway.tool_calls import parse

pytestmark = pytest.mark.unit

TOOLS = ["add", "search"]


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_one_call_becomes_an_openai_tool_call() -> None:
    parsed = parse(block('{"name": "add", "arguments": {"a": 2, "b": 3}}'), TOOLS)
    assert parsed.content is None
    [call] = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}


def test_several_calls_and_the_text_around_them() -> None:
    text = "Let me look.\n" + block('{"name": "search", "arguments": {"q": "x"}}') + "\n" + \
        block('{"name": "add", "arguments": "{\\"a\\": 1}"}')
    parsed = parse(text, TOOLS)
    assert parsed.content == "Let me look."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["search", "add"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"q": "x"}, {"a": 1}]
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    assert json.loads(parse(block('{"name": "add"}'), TOOLS).tool_calls[0]["function"]["arguments"]) == {}


@pytest.mark.parametrize("text", [
    block('{"name": "add", "arguments": {"a": 2'),  # bad JSON
    block('{"arguments": {"a": 2}}'),  # no name
    block('{"name": 7, "arguments": {}}'),
    block('{"name": "delete_everything", "arguments": {}}'),  # a tool the request did not offer
    block('["add", {}]'),
    block('{"name": "add", "arguments": [1, 2]}'),
    block('{"name": "add", "arguments": "not json"}'),
    block('{"name": "add", "arguments": {}}') + block("{oops"),  # one bad block spoils the reply
    '<tool_call>\n{"name": "add", "arguments": {"a": 2}}',  # cut by max_tokens
    "no call here",
])
def test_anything_but_well_formed_calls_of_known_tools_is_plain_text(text: str) -> None:
    parsed = parse(text, TOOLS)
    assert parsed.content == text and parsed.tool_calls == []


def test_no_tools_offered_means_no_parsing() -> None:
    text = block('{"name": "add", "arguments": {}}')
    assert parse(text, []).tool_calls == [] and parse(text, []).content == text


@given(st.text(alphabet=st.sampled_from(list('<>/{}"[]:, \nabdtoolcalnmegurs_')), max_size=200))
def test_parsing_never_raises(text: str) -> None:
    parsed = parse(text, TOOLS)
    assert parsed.tool_calls or parsed.content == text


def test_a_chat_choice_carries_the_calls_and_says_so() -> None:
    out = Output(text=block('{"name": "add", "arguments": {"a": 1}}'), token_ids=[1], logprobs=[-0.1],
                 finish_reason="stop")
    choice = ResponseFormat(tokenizer=None, base_model="m").choice("chat", 0, out, False, TOOLS)  # type: ignore[arg-type]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    plain = ResponseFormat(tokenizer=None, base_model="m").choice("chat", 0, out, False)  # type: ignore[arg-type]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": out.text}
