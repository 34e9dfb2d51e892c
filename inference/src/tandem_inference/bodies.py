"""What tandem's HTTP servers (the gateway, the transformers engine) share, and every JSON body is held to.

Python's JSON reader accepts more than JSON does, and more than a model can take: `NaN` and
`Infinity` literals, and `\\ud800` escapes that decode to lone surrogates, text that no
tokenizer can encode and no UTF-8 encoder can write back. `Body` refuses both, anywhere in a
body, with a 422 naming the field. Error replies echo what the client sent, so they are built
with `error_response`, which renders any content: a reply that failed to serialize would turn
a client error into a 500 and close the connection under the next request.

Both servers also speak OpenAI's rules on logprobs (`ChatLogprobs`, `by_text`), stop work for a
client that left (`client_left`) and trust loopback where no key is set (`is_loopback`).
"""

from __future__ import annotations

import ipaddress
import math
import reprlib
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

#: How much of a bad value an error reply quotes, in characters.
QUOTE_CHARS = 200
#: Most validation problems one 422 lists (a long list of bad token ids has one per id).
MAX_PROBLEMS = 20
#: Most alternatives per token a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20

_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = QUOTE_CHARS
_quote.maxlevel = 3


class Body(BaseModel):
    """Base of request bodies: unknown fields are ignored (OpenAI and SGLang clients send many);
    non-finite numbers and lone surrogates are refused wherever they are."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    checks_values: ClassVar[bool] = True
    """Whether this model's fields are walked for those values (`Part`s are, with their body's)."""

    @field_validator("*", mode="before")
    @classmethod
    def _json_text_and_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if cls.checks_values:
            _refuse_invalid(value, info.field_name or "body")
        return value

    @model_validator(mode="before")
    @classmethod
    def _extra_json_text_and_numbers(cls, data: Any) -> Any:
        """The fields a body does not declare (ignored, but echoed in logs and kept by clients that
        send them, like `user` and `metadata`) are held to the same rule."""
        if cls.checks_values and isinstance(data, dict):
            for key, value in data.items():
                if key not in cls.model_fields:
                    _refuse_invalid(value, str(key)[:QUOTE_CHARS])
        return data


class Part(Body):
    """A model only ever read inside a `Body` (a message, a tool, a content part): the body's own
    walk has checked its values already, so it is not walked again. Each nesting level walking its
    whole subtree made a 3 MB body of 90,000 parts cost seconds of the event loop."""

    checks_values: ClassVar[bool] = False


class ChatLogprobs(Body):
    """OpenAI's chat rule: `top_logprobs` (alternatives per token) needs `logprobs: true`.

    A mixin of chat bodies, which declare both fields where they belong in the body (so that
    their validation problems come in the body's order).
    """

    if TYPE_CHECKING:
        logprobs: bool
        top_logprobs: int | None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatLogprobs:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true; set both, or drop top_logprobs")
        return self

    @property
    def alternatives_per_token(self) -> int:
        """How many alternatives per token the reply lists (0: none)."""
        return (self.top_logprobs or 0) if self.logprobs else 0


def _refuse_invalid(value: Any, path: str) -> None:
    """A validation error saying what `first_invalid` found in `value`, if anything."""
    problem = first_invalid(value, path)
    if problem is not None:
        raise PydanticCustomError("invalid_value", "{problem}", {"problem": problem})


def first_invalid(value: Any, path: str) -> str | None:
    """Where `value` holds a lone surrogate or a non-finite number, said in words; else None.

    Iterative, so a deeply nested value cannot exhaust the stack.
    """
    if not _holds_invalid(value):  # the common case, without a path for every value
        return None
    todo: list[tuple[str, Any]] = [(path, value)]
    while todo:
        where, item = todo.pop()
        if isinstance(item, str):
            bad = _surrogate_at(item)
            if bad is not None:
                return (f"{where} has a lone surrogate U+{ord(item[bad]):04X} at index {bad}, which is not "
                        "Unicode text; send valid UTF-8 (a pair escaped as \\ud83d\\ude00, never one half)")
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{where} is {item}; JSON numbers must be finite"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str) and _surrogate_at(key) is not None:
                    return f"{where} has a key with a lone surrogate, {printable(key)!r}; send valid UTF-8"
                if isinstance(sub, _CONTAINERS):
                    todo.append((f"{where}.{key}", sub))
        elif isinstance(item, list | tuple):
            # ints, bools and None cannot be wrong: long token-id lists cost no paths
            todo.extend((f"{where}[{i}]", sub) for i, sub in enumerate(item) if isinstance(sub, _CONTAINERS))
    return None


_CONTAINERS = (str, float, dict, list, tuple)


def _holds_invalid(value: Any) -> bool:
    """Whether `first_invalid` would find anything in `value` (the same walk, without paths)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if not item.isascii() and _surrogate_at(item) is not None:
                return True
        elif isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not key.isascii() and _surrogate_at(key) is not None:
                    return True
            todo.extend(sub for sub in item.values() if isinstance(sub, _CONTAINERS))
        elif isinstance(item, list | tuple):
            todo.extend(sub for sub in item if isinstance(sub, _CONTAINERS))
    return False


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def quote(value: Any) -> str:
    """A short, printable rendering of a client's value for an error reply."""
    return printable(_quote.repr(value))


def printable(text: str) -> str:
    """`text` with lone surrogates written as backslash escapes, so it encodes as UTF-8."""
    return text if _surrogate_at(text) is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def validation_problems(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pydantic's errors made safe to send: the location, message and type, the input quoted."""
    out = []
    for e in errors:
        loc = [p if isinstance(p, int) else printable(str(p)) for p in e.get("loc", ())]
        entry: dict[str, Any] = {"loc": loc, "msg": printable(str(e.get("msg", ""))), "type": str(e.get("type", ""))}
        if "input" in e:
            entry["input"] = quote(e["input"])
        out.append(entry)
    return out


def invalid_request(exc: RequestValidationError,
                    content_type: str | None = None) -> tuple[str, str | None, list[dict[str, Any]]]:
    """A 422's message, the field it names first (OpenAI's `param`) and its problems, safe to send.

    Lists at most MAX_PROBLEMS problems; the message names the first five. A body that is no
    JSON at all (or was not sent as JSON: `content_type`) is said so, with what to send instead.
    """
    errors = list(exc.errors())
    problems = validation_problems(errors[:MAX_PROBLEMS])
    unread = unreadable_body(errors[0], content_type) if errors else None
    if unread is not None:
        return unread, None, problems
    where = "; ".join(f"{location(p)}: {p['msg']}" for p in problems[:5])
    return f"invalid request: {where}", field_of(problems[0]) if problems else None, problems


def unreadable_body(first: dict[str, Any], content_type: str | None) -> str | None:
    """What is wrong with a body that never reached the schema, or None when it did.

    FastAPI reports invalid JSON as a `json_invalid` error at the character it stopped at; a body
    not sent as JSON as its raw bytes failing to be an object at `body`; and valid JSON that is no
    object (a string: often an object encoded twice) as that value failing to be one.
    """
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        why = printable(str((first.get("ctx") or {}).get("error") or "not JSON"))
        at = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
        return f"the body is not valid JSON: {why}{at}; send one JSON object"
    if loc != ("body",) or first.get("type") != "model_attributes_type":
        return None
    value = first.get("input")
    if isinstance(value, bytes):
        sent = printable(content_type) if content_type else "none"
        return (f"the body was not read as JSON (Content-Type: {sent}); send one JSON object with "
                "Content-Type: application/json")
    kind = ("a string (an object encoded twice?)" if isinstance(value, str) else "an array" if isinstance(value, list)
            else "null" if value is None else "a boolean" if isinstance(value, bool) else "a number")
    return f"the body is JSON {kind}, not an object; send one JSON object"


def location(problem: dict[str, Any]) -> str:
    """Where in the body a validation problem is, dotted (`messages.0.content`)."""
    return ".".join(str(p) for p in problem.get("loc", ()) if p != "body") or "body"


def field_of(problem: dict[str, Any]) -> str | None:
    """The top-level field a validation problem is about: OpenAI's `param`."""
    fields = [p for p in problem.get("loc", ()) if p != "body"]
    return str(fields[0]) if fields else None


def error_response(status: int, body: dict[str, Any]) -> JSONResponse:
    """A JSON reply that always serializes: non-finite numbers become strings, lone surrogates escapes."""
    return JSONResponse(_safe(body), status_code=status)


def _safe(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {_safe(str(k)): _safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return printable(str(value))


def by_text(alternatives: list[tuple[str, float]]) -> dict[str, float]:
    """OpenAI's completions shape, {token: logprob}; of tokens that read the same, the likeliest."""
    out: dict[str, float] = {}
    for text, logprob in alternatives:
        out.setdefault(text, logprob)
    return out


async def client_left(request: Request) -> None:
    """Return when the client of `request` is gone (its body is read: only the disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or `localhost`) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond loopback
