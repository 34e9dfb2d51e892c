"""The gateway holds a request to the length it asked for: `max_tokens` and chat's
`max_completion_tokens` are refused, never ignored, where they would not be what is sampled
(the `url` fixture of conftest.py: the gateway in front of the real engine)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "What is 2 plus 2?"}]


def tokens(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    usage: int = reply.json()["usage"]["completion_tokens"]
    return usage


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 3}, {"max_tokens": 1}])
def test_completions_refuse_chats_max_completion_tokens_naming_max_tokens(url: str, extra: dict[str, Any]) -> None:
    """OpenAI's completions API has no max_completion_tokens: a 422, not a reply of another length."""
    resp = httpx.post(f"{url}/v1/completions",
                      json={"model": "base", "prompt": "Count:", "max_completion_tokens": 1, **extra})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "max_completion_tokens", error
    assert "send max_tokens, the completions API's field" in error["message"], error

    body = {"model": "base", "prompt": "Count:", "max_tokens": 2, "temperature": 0}
    assert tokens(httpx.post(f"{url}/v1/completions", json={**body, "max_completion_tokens": None})) == 2


@pytest.mark.parametrize(("max_tokens", "max_completion_tokens"), [(1, 4), (4, 1)])
def test_chat_refuses_max_tokens_and_max_completion_tokens_that_differ(
    url: str, max_tokens: int, max_completion_tokens: int
) -> None:
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": "base", "messages": CHAT, "max_tokens": max_tokens,
                                                           "max_completion_tokens": max_completion_tokens})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "max_completion_tokens", error
    assert f"max_tokens {max_tokens} and max_completion_tokens {max_completion_tokens} differ" in error["message"]


def test_chat_takes_either_field_or_both_when_they_agree(url: str) -> None:
    body = {"model": "base", "messages": CHAT, "temperature": 0}
    replies = []
    for fields in ({"max_tokens": 2}, {"max_completion_tokens": 2}, {"max_tokens": 2, "max_completion_tokens": 2},
                   {"max_tokens": 2, "max_completion_tokens": None}):
        reply = httpx.post(f"{url}/v1/chat/completions", json={**body, **fields})
        assert tokens(reply) <= 2, fields
        replies.append((reply.json()["choices"][0]["message"]["content"], tokens(reply)))
    assert len(set(replies)) == 1, replies
