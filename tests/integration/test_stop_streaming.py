"""Stop strings that span tokens: a streamed reply adds up to exactly the unstreamed one.

Greedy (temperature 0) generation is deterministic, so for any stop strings the deltas of a
stream must concatenate to the text of the same request unstreamed, on every surface: the
gateway's chat and completions, and the engine's OpenAI routes and native /generate (whose
stream repeats the whole text so far; its last text must be the unstreamed text). Stop strings
are drawn mostly from inside the unstopped reply, so they end it, often across a token boundary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.servers import BASE, Servers
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration

MAX_TOKENS = 16
PROMPTS = ["Count to ten:", "The digits are", "Once upon a time"]
SURFACES = ["gateway_chat", "gateway_text", "engine_chat", "engine_text", "engine_native"]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as client:
        yield client


def request(servers: Servers, surface: str, prompt: str, stop: list[str], stream: bool) -> tuple[str, dict]:
    """(url, body) of a greedy request for `prompt` on `surface`."""
    sampling: dict[str, Any] = {"temperature": 0, "stream": stream}
    if stop:
        sampling["stop"] = stop
    if surface == "engine_native":
        params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, **({"stop": stop} if stop else {})}
        return f"{servers.engine}/generate", {"text": prompt, "sampling_params": params, "stream": stream}
    base = servers.gateway if surface.startswith("gateway") else servers.engine
    if surface.endswith("chat"):
        body = {"model": BASE, "messages": [{"role": "user", "content": prompt}], **sampling}
        return f"{base}/v1/chat/completions", {**body, "max_tokens": MAX_TOKENS}
    return f"{base}/v1/completions", {"model": BASE, "prompt": prompt, "max_tokens": MAX_TOKENS, **sampling}


def reply(http: httpx.Client, servers: Servers, surface: str, prompt: str, stop: list[str], stream: bool) -> str:
    """The reply's text: whole, or the stream's deltas joined (native: the stream's last text)."""
    url, body = request(servers, surface, prompt, stop, stream)
    if not stream:
        response = http.post(url, json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        if surface == "engine_native":
            return str(out["text"])
        choice = out["choices"][0]
        return str(choice["message"]["content"] if surface.endswith("chat") else choice["text"])
    with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read().decode()
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    if surface == "engine_native":
        return str(chunks[-1]["text"])
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            if surface.endswith("chat"):
                text += (choice.get("delta") or {}).get("content") or ""
            else:
                text += choice["text"]
    return text


@pytest.fixture(scope="module")
def unstopped(http: httpx.Client, servers: Servers) -> dict[tuple[str, str], str]:
    """The greedy reply without stop strings, for each surface and prompt."""
    return {(s, p): reply(http, servers, s, p, [], stream=False) for s in SURFACES for p in PROMPTS}


@st.composite
def cases(draw: st.DrawFn, unstopped: dict[tuple[str, str], str]) -> tuple[str, str, list[str]]:
    surface, prompt = draw(st.sampled_from(SURFACES)), draw(st.sampled_from(PROMPTS))
    text = unstopped[(surface, prompt)].replace("\ufffd", "")  # no stop string holds half a character
    alphabet = st.sampled_from(sorted(set(text)) or ["x"])

    def stop() -> str:
        if text and draw(st.integers(0, 3)):  # mostly from inside the reply, so that it ends there
            start = draw(st.integers(0, len(text) - 1))
            return text[start : start + draw(st.integers(1, 6))]
        return draw(st.text(alphabet, min_size=1, max_size=4))

    return surface, prompt, [stop() for _ in range(draw(st.integers(1, 3)))]


@settings(max_examples=50, deadline=None, database=None)
@given(data=st.data())
def test_a_stream_with_stop_strings_adds_up_to_the_unstreamed_reply(
    data: st.DataObject, http: httpx.Client, servers: Servers, unstopped: dict[tuple[str, str], str]
) -> None:
    surface, prompt, stops = data.draw(cases(unstopped))
    whole = reply(http, servers, surface, prompt, stops, stream=False)
    streamed = reply(http, servers, surface, prompt, stops, stream=True)
    assert streamed == whole, (surface, prompt, stops)
    assert unstopped[(surface, prompt)].startswith(whole)
