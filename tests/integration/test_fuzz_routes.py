"""Fuzzing every route of the gateway and of the engine: no input yields a 5xx or a dropped connection.

Two sources of input, both hypothesis-driven and bounded so that the tier runs in `make test`:
- schemathesis turns each server's own OpenAPI schema into requests for every operation, valid
  ones and ones that break the schema (wrong types, missing fields, bad path and query values);
- hostile JSON: a valid generation request with one value replaced by what JSON parsers let
  through (NaN, Infinity, lone surrogates, huge integers, deep nesting, long text, wrong types),
  sent as raw bytes on one kept-alive connection.

Every answer must be below 500 and arrive whole; every 4xx of a generation route must be
OpenAI-shaped. The engine's /release_memory_occupation is left out: after it, generation is
refused with 503 until a resume, which is that route's contract, not a client error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from helpers.servers import BASE, Servers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration

MAX_TOKENS = 4  # on both servers (the `servers` fixture): every generated reply is short
SKIPPED = {"POST /release_memory_occupation"}
GENERATION = {"/v1/chat/completions", "/v1/completions", "/generate"}
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def check(response: Any, path: str) -> None:
    """No 5xx; a generation route's 4xx is `{"error": {message, type, param, code}}`."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if 400 <= response.status_code < 500 and path in GENERATION:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], error


# schemathesis: every operation of each server's OpenAPI schema ------------------------------------
def operations(url: str) -> st.SearchStrategy[Any]:
    raw = httpx.get(f"{url}/openapi.json", timeout=30).json()
    ops = [r.ok() for r in schemathesis.openapi.from_dict(raw).get_all_operations()]
    ops = [op for op in ops if f"{op.method.upper()} {op.path}" not in SKIPPED]
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    return st.one_of([op.as_strategy(generation_mode=mode) for op in ops for mode in modes])


def naming_the_base_model(case: Any, base: bool) -> Any:
    """Half the generation requests name the served model, so that they reach the engine."""
    if base and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = BASE
    return case


@pytest.mark.parametrize("server", ["gateway", "engine"])
def test_schema_driven_requests_never_get_a_5xx(servers: Servers, session: requests.Session, server: str) -> None:
    url = servers.gateway if server == "gateway" else servers.engine
    cases = st.tuples(operations(url), st.booleans()).map(lambda pair: naming_the_base_model(*pair))

    @FUZZ
    @given(cases)
    def run(case: Any) -> None:
        check(case.call(base_url=url, session=session, timeout=60), case.path)

    run()


# hostile JSON: one value of a valid request replaced ---------------------------------------------
REQUESTS = {
    "gateway": [
        ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "temperature": 0.5, "stop": ["x"], "logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 2, "n": 2, "logprobs": 1,
                             "stream": True}),
    ],
    "engine": [
        ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "seed": 1, "stop": "x", "logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"model": BASE, "prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 2, "stream": True}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0.5, "stop": ["x"]},
                       "return_logprob": True, "top_logprobs_num": 2, "rid": "r"}),
    ],
}

scalars = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 2**63, -(2**63) - 1, 10**30, 0, -1, 1e308, -0.0, True, None]),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "", "\ufffd", "base:x", "@v9", "x" * 100_000]),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
)
hostile = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
deep = st.integers(100, 100_000).map(lambda depth: f"<nested {depth} deep>")  # written by raw_json


def paths(body: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in `body` a value can be put: each key and index, and one new key per object."""
    found = [prefix]
    if isinstance(body, dict):
        found.append((*prefix, "new-field"))
        for key, value in body.items():
            found += paths(value, (*prefix, key))
    elif isinstance(body, list):
        for i, value in enumerate(body):
            found += paths(value, (*prefix, i))
    return found


def put(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of `body` with `value` at `path`."""
    if not path:
        return value
    copy = dict(body) if isinstance(body, dict) else list(body)
    copy[path[0]] = put(copy[path[0]], path[1:], value) if len(path) > 1 else value
    return copy


def raw_json(value: Any) -> bytes:
    """JSON as a lenient client writes it: NaN and Infinity literals, lone surrogates as \\u escapes,
    and arrays nested deeper than any JSON writer goes where `deep` put a placeholder."""
    text = json.dumps(value, allow_nan=True, ensure_ascii=True)
    return re.sub(r'"<nested (\d+) deep>"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), text).encode()


@pytest.mark.parametrize("server", ["gateway", "engine"])
def test_hostile_json_values_never_get_a_5xx(servers: Servers, server: str) -> None:
    url = servers.gateway if server == "gateway" else servers.engine

    with httpx.Client(base_url=url, timeout=60) as http:  # one connection: a crash would drop it

        @FUZZ
        @given(st.sampled_from(REQUESTS[server]), st.data())
        def run(request: tuple[str, dict[str, Any]], data: st.DataObject) -> None:
            path, body = request
            where = data.draw(st.sampled_from(paths(body)))
            value = data.draw(st.one_of(hostile, deep))
            response = http.post(path, content=raw_json(put(body, where, value)),
                                 headers={"content-type": "application/json"})
            check(response, path)
            assert response.headers.get("connection") != "close", response.text[:300]

        run()
