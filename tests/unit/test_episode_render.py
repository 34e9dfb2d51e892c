"""Delta rendering with the tiny model's chat template: the ids an episode's later turn adds.

An episode is its prompt, then per turn the delta and the sampled ids. When the sampled ids are
exactly the template's tokens of the reply, prompt + sampled + delta must be the template's
render of the whole conversation: the delta is the template's own tokens for the new messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem_inference.gateway import prompts
from tandem_inference.gateway.schemas import ChatMessage

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def ids(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    return prompts.encode(tok, prompts.render(tok, messages, tools, generation_prompt=True))


def msgs(*raw: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


START = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2 plus 3?"}]
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]}


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("new", [
    [{"role": "user", "content": "And 4 more?"}],
    [{"role": "tool", "content": "5", "tool_call_id": "call_1"}],
    [{"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}, {"role": "user", "content": "so?"}],
    [],
])
def test_prompt_sampled_and_delta_are_the_templates_render_of_the_whole_conversation(
        tok: Any, tools: list[dict[str, Any]] | None, new: list[dict[str, Any]]) -> None:
    reply = {"role": "assistant", "content": "It is 5."}
    end = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = prompts.encode(tok, "It is 5.") + [end]  # ended on the end-of-turn token, as the engine does
    delta = prompts.delta_ids(tok, msgs(*new), tools, sampled)
    whole = prompts.encode(tok, prompts.render(tok, [*START, reply, *new], tools, generation_prompt=True))
    assert ids(tok, START, tools) + sampled + delta == whole


def test_a_turn_cut_by_max_tokens_is_closed_by_the_delta(tok: Any) -> None:
    sampled = prompts.encode(tok, "It is")  # no end-of-turn token: max_tokens cut it
    delta = prompts.delta_ids(tok, msgs({"role": "user", "content": "Go on."}), None, sampled)
    assert tok.decode(delta) == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    closed = prompts.delta_ids(tok, msgs({"role": "user", "content": "Go on."}), None, [*sampled, end])
    assert closed == delta[1:]


def test_tool_results_after_a_tool_call_render_the_qwen_way(tok: Any) -> None:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    delta = prompts.delta_ids(tok, msgs({"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}),
                              TOOLS, [*prompts.encode(tok, '<tool_call>\n{"name": "add"}\n</tool_call>'), end])
    assert tok.decode(delta) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n"
                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a whole conversation with a call in it renders as Qwen2.5 does
    text = prompts.render(tok, [*START, ChatMessage.model_validate(CALL).as_template_input()], TOOLS,
                          generation_prompt=False)
    assert text.startswith("<|im_start|>system\nYou add.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n'
                         "</tool_call><|im_end|>\n")


def test_tool_choice_none_leaves_the_tools_out(tok: Any) -> None:
    from tandem_inference.gateway.schemas import ChatRequest

    body = ChatRequest.model_validate({"model": "m", "messages": START, "tools": TOOLS, "tool_choice": "none"})
    assert prompts.chat_ids(tok, body) == ids(tok, START)
    body = ChatRequest.model_validate({"model": "m", "messages": START, "tools": TOOLS, "tool_choice": "auto"})
    assert prompts.chat_ids(tok, body) == ids(tok, START, TOOLS) != ids(tok, START)


def test_a_developer_message_renders_as_the_system_message(tok: Any) -> None:
    """OpenAI's newer name for the system role; the chat templates of open models know only `system`."""
    from tandem_inference.gateway.schemas import ChatRequest

    developer = [{"role": "developer", "content": "You add."}, START[1]]
    body = ChatRequest.model_validate({"model": "m", "messages": developer})
    assert prompts.chat_ids(tok, body) == ids(tok, START)
