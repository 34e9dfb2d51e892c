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
