"""Where the engine's failures enter tandem: error bodies and httpx errors become tandem errors.

Engines answer errors in several shapes (SGLang alone has three, vLLM OpenAI's nested one and a
flat `{"error": "..."}`); `engine_message` finds the
engine's own words in any of them. `refusal` turns an error status into the engine client's
branch of the error tree, `unreachable` an httpx error; both name the URL (and the adapter),
so a log line says which engine and which call failed. Nothing here knows an engine's words:
whether a refused generation means an adapter the engine does not hold, each engine says its
own way, so its client reads it (`HttpEngine._adapter_missing`) and tells `refusal`.
"""

from __future__ import annotations

import json

import httpx

from tandem_inference.engines.calls import CallKind
from tandem_inference.errors import (
    AdapterLoadRefused,
    AdapterMissing,
    EngineResponseError,
    EngineTimeout,
    EngineUnreachable,
)

#: Longest part of an engine's error body quoted in a message, in characters.
MESSAGE_CHARS = 500


def engine_message(resp: httpx.Response) -> str:
    """The engine's own words from an error body, whatever shape it has.

    SGLang answers `{"error": {"message": ...}}` on /generate, `{"success": false,
    "error_message": ...}` on adapter routes and a flat `{"object": "error", "message": ...}`
    on OpenAI routes; vLLM `{"error": {"message", "type", "param", "code"}}`, and
    `{"error": "..."}` on its pause and auth refusals; FastAPI answers `{"detail": ...}`.
    """
    return message_in(resp.content, resp.status_code)


def message_in(content: bytes, status: int) -> str:
    """The engine's own words in the error body `content` of a `status` reply (see `engine_message`);
    for a body read in part, as a streamed call reads it."""
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace").strip()[:MESSAGE_CHARS] or f"HTTP {status}"
    return message_of(body) or f"HTTP {status}"


def message_of(body: object) -> str | None:
    """The message in a decoded error body (see `engine_message`); None if it holds none."""
    if not isinstance(body, dict):
        return str(body)[:MESSAGE_CHARS] if body else None
    err = body.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str) and err:
        return err
    for key in ("error_message", "message"):
        if body.get(key):
            return str(body[key])
    detail = body.get("detail")
    if detail:
        return detail if isinstance(detail, str) else json.dumps(detail)[:MESSAGE_CHARS]
    return None


def refusal(
    kind: CallKind, url: str, status: int, message: str, adapter: str | None, *, adapter_missing: bool = False,
) -> EngineUnreachable | EngineResponseError:
    """The error for an engine that answered `status` with `message` to a `kind` call.

    `adapter_missing`: the engine's client read the answer as a generation naming an adapter the
    engine does not hold (AdapterMissing, unless the engine was not ready).
    """
    if status == 503:
        return EngineUnreachable(f"engine at {url} is not ready (503): {message}")
    if kind is CallKind.LOAD and adapter is not None:
        return AdapterLoadRefused(
            f"engine at {url} refused to load adapter {adapter!r} ({status}): {message}",
            adapter=adapter, status_code=status, engine_message=message,
        )
    if kind is CallKind.GENERATE and adapter_missing:
        return AdapterMissing(f"engine at {url} does not hold the adapter the generation named ({status}): {message}",
                              status_code=status, engine_message=message)
    what = kind.value
    if adapter and kind is not CallKind.GENERATE:
        what = f"{kind.value} of adapter {adapter!r}"
    return EngineResponseError(
        f"engine at {url} failed the {what} ({status}): {message}", status_code=status, engine_message=message,
    )


def unreachable(
    kind: CallKind, url: str, exc: httpx.HTTPError, timeout_s: float, *, adapter: str | None = None
) -> EngineUnreachable:
    """The error for a `kind` call that httpx could not complete (`timeout_s`: the call's timeout)."""
    about = f" (adapter {adapter!r})" if adapter else ""
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return EngineTimeout(
            f"engine at {url} did not answer the {kind.value}{about} within {timeout_s:g} s; "
            f"it may be overloaded or stuck"
        )
    return EngineUnreachable(
        f"engine at {url} cannot be reached for the {kind.value}{about}: {type(exc).__name__}: {exc}; "
        "is it running? check TANDEM_ENGINE__URL"
    )
