"""Tool calls read from a model's text into OpenAI's `tool_calls`, in the chat template's format.

Qwen2.5 (and the tiny model's template) has the model write each call as a JSON object between
tags, one block per call:

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

A reply whose every block parses into a call of a known tool becomes `tool_calls` (each with
an id `call_<random>` and its arguments as a JSON text) and the text around the blocks its
content (null when there is none). Anything less — a block that is not JSON, has no name,
names a tool the request did not offer, or never closes — leaves the reply as plain text: the
model's output is never an error of the request.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class Parsed:
    """A reply as OpenAI's message has it: content, and the calls (none for plain text)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse(text: str, tools: Collection[str]) -> Parsed:
    """`text` split into content and calls of the functions named in `tools`; plain text when
    there are no tools, no calls, or any call is malformed."""
    if not tools or OPEN not in text:
        return Parsed(text)
    calls = []
    for block in _BLOCK.findall(text):
        call = _call(block, tools)
        if call is None:
            return Parsed(text)
        calls.append(call)
    rest = _BLOCK.sub("", text)
    if OPEN in rest or CLOSE in rest or not calls:  # a block that never closes (cut by max_tokens)
        return Parsed(text)
    return Parsed(rest.strip() or None, calls)


def _call(block: str, tools: Collection[str]) -> dict[str, Any] | None:
    """One block as an OpenAI tool call; None if it is not a call of one of `tools`."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or name not in tools:
        return None
    if isinstance(arguments, str):  # some models write the arguments as a JSON text already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class StreamedCalls:
    """One streamed choice's text, with anything that may be a tool call held back.

    Text before the first `<tool_call>` streams as content as it comes (a tail that could begin
    the tag waits for the next piece); from the tag on, the text is held. When the choice ends,
    the held text is parsed as the unstreamed reply would be: calls of known tools come out in
    OpenAI's delta shape (per call a first delta with its index, id, type and name, then its
    arguments in pieces) and the choice finishes with `tool_calls`; anything else is let out as
    the content it is.
    """

    ARGUMENT_PIECE_CHARS = 8

    def __init__(self, tools: Collection[str]) -> None:
        self.tools = tools
        self.held = ""
        self.held_from_token: int | None = None
        """The first token whose text is held (its logprobs go out with the text, if it is let out)."""

    def feed(self, text: str, start_token: int) -> str:
        """The part of `text` that is content for sure; the rest is held."""
        if not self.tools:
            return text
        if self.held_from_token is None:
            self.held_from_token = start_token
        self.held += text
        if OPEN in self.held:
            cut = self.held.index(OPEN)
        else:
            cut = len(self.held)
            for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1):  # a tail that may begin the tag
                if OPEN.startswith(self.held[-k:]):
                    cut = len(self.held) - k
                    break
        out, self.held = self.held[:cut], self.held[cut:]
        if not self.held:
            self.held_from_token = None
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content to let out, tool-call deltas) once the choice has ended."""
        held, self.held = self.held, ""
        parsed = parse(held, self.tools) if held else Parsed(None)
        if not parsed.tool_calls:
            return held, []
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.tool_calls):
            deltas.append({"index": index, "id": call["id"], "type": "function",
                           "function": {"name": call["function"]["name"], "arguments": ""}})
            arguments = call["function"]["arguments"]
            for at in range(0, len(arguments), self.ARGUMENT_PIECE_CHARS):
                deltas.append({"index": index, "function": {"arguments": arguments[at:at + self.ARGUMENT_PIECE_CHARS]}})
        return parsed.content or "", deltas
