"""The SDK's connections to a stack: the gateway over HTTP and Redis, opened from one set of settings.

`Session` is what a `Client` talks through, and what a run's episodes and train handles reach
through their run (`SessionRun`), so that neither needs the client itself. Every answer of the
gateway becomes a JSON object or a tandem error: `BackendUnavailable` when it does not answer,
`GatewayError` when it refuses (with its own message) or answers with something that is not
tandem's. Redis is reached through the run registry and the event stream.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, Self

import httpx
import redis

from tandem.errors import BackendUnavailable, GatewayError, ValidationFailed
from tandem.events import EventStream
from tandem.registry import Registry
from tandem.settings import ClientSettings, load

__all__ = ["Session", "SessionRun"]


class Session:
    """The gateway (`http`, `post`/`get`/`delete`) and Redis (`conn`, `registry`, `events`) of one stack.

    `gateway_url` and `redis_url` override the settings (TANDEM_GATEWAY_URL, TANDEM_REDIS__URL);
    `http` and `conn` are used as given (a test's transport, a shared connection) and closed by
    `close()`.
    """

    def __init__(
        self,
        gateway_url: str | None = None,
        redis_url: str | None = None,
        *,
        api_key: str | None = None,
        settings: ClientSettings | None = None,
        http: httpx.Client | None = None,
        conn: redis.Redis | None = None,
    ) -> None:
        settings = settings or load(ClientSettings)  # a bad TANDEM_ variable: ConfigError naming it
        updates: dict[str, Any] = {}
        if gateway_url:
            updates["gateway_url"] = gateway_url
        if redis_url:
            updates["redis"] = settings.redis.model_copy(update={"url": redis_url})
        self.settings = settings.model_copy(update=updates)
        key = api_key or (self.settings.api_key.get_secret_value() if self.settings.api_key else None)
        self.keyed = key is not None
        self.http = http or httpx.Client(
            base_url=self.settings.gateway_url,
            timeout=httpx.Timeout(self.settings.request_timeout_s, connect=10.0),
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        self.conn = conn or self.settings.redis.connect()
        self.registry = Registry(self.conn)
        self.events = EventStream(self.conn)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to the gateway; its JSON object answer, or GatewayError / BackendUnavailable."""
        return self._request("POST", path, body)

    def get(self, path: str) -> dict[str, Any]:
        """GET from the gateway; its JSON object answer, or GatewayError / BackendUnavailable."""
        return self._request("GET", path, None)

    def delete(self, path: str) -> dict[str, Any]:
        """DELETE on the gateway; its JSON object answer ({} for 204), or GatewayError / BackendUnavailable."""
        return self._request("DELETE", path, None)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        content = None
        if body is not None:
            # encoded here, not by httpx: NaN and lone surrogates are sent (JSON's NaN, a \ud800 escape)
            # for the gateway to refuse naming the field, instead of failing in the client unnamed
            try:
                text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
                try:
                    content = text.encode()
                except UnicodeEncodeError:  # a lone surrogate: escaped, as only ASCII output can carry it
                    content = json.dumps(body, separators=(",", ":")).encode()
            except (TypeError, ValueError) as exc:
                raise ValidationFailed(f"{method} {path}: the request holds a value JSON cannot carry ({exc}); pass "
                                       "plain numbers, strings, lists and dicts") from exc
        try:
            resp = self.http.request(method, path, content=content,
                                     headers={"Content-Type": "application/json"} if content is not None else None)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"gateway at {self.settings.gateway_url} did not answer {path} ({exc}); "
                "is the stack up? set TANDEM_GATEWAY_URL"
            ) from exc
        try:
            payload: Any = resp.json()
        except ValueError:
            payload = resp.text
        if resp.status_code >= 400:
            fix = ""
            if resp.status_code == 401:  # a CLI user sends no headers: name the setting that sends the key
                given = "a wrong one is set" if self.keyed else "none is set"
                fix = f"; the gateway takes a key: set TANDEM_API_KEY to it ({given}), or pass Client(api_key=...)"
            raise GatewayError(f"{path} -> {resp.status_code}: {_message(payload) or resp.text}{fix}",
                               status_code=resp.status_code, body=payload)
        if resp.status_code == 204:
            return {}
        if not isinstance(payload, dict):
            raise GatewayError(
                f"{path} -> {resp.status_code} with a body that is not a JSON object ({resp.text[:200]!r}); "
                f"is TANDEM_GATEWAY_URL ({self.settings.gateway_url}) tandem's gateway?",
                status_code=resp.status_code, body=payload,
            )
        return payload

    def close(self) -> None:
        self.http.close()
        self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SessionRun(Protocol):
    """A run as its episodes and train handles see it: its name and the session it talks through
    (`tandem.client.Run` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def client(self) -> Session: ...


def _message(payload: object) -> str | None:
    """The error message of a gateway (OpenAI `error.message`, FastAPI `detail`) or None."""
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return str(message or payload.get("detail") or "") or None
