"""tandem_inference's errors, one tree under tandem's root.

    TandemError                    (tandem.errors)
    └── InferenceError             anything the inference side raises on purpose
        ├── EngineError            the transformers engine refused or failed an operation
        │   ├── InvalidRequest     a generation request with a bad value (HTTP 400; names it)
        │   ├── AdapterNotLoaded   a request or unload naming an adapter that is not loaded (400)
        │   ├── AdapterLoadFailed  an adapter the engine refuses to load; nothing changed (400)
        │   │   └── AdapterLoadError   (engine client) the engine answered a load with an error;
        │   │                          carries the adapter name and the engine's message
        │   ├── WeightsLoadFailed  a full-weight checkpoint the engine refuses; the old weights serve (400)
        │   ├── EngineUnavailable  no model to run: memory released or not loaded yet (503);
        │   │   │                  (engine client) the engine cannot be reached
        │   │   └── EngineTimeout  (engine client) the engine did not answer within the call's timeout
        │   ├── EngineBusy         in-flight requests did not finish in time (503)
        │   └── EngineResponseError  (engine client) the engine answered an error status;
        │                          carries the status and the engine's message
        ├── ModelNotFound          (gateway) a `model` that names no run or loaded version (404);
        │                          carries the known names
        └── Overloaded             (gateway) no room for more generation in flight or in the
                                   queue (429 with Retry-After); carries the reason

Errors from torch, transformers and peft are translated where they enter tandem_inference,
with a message that names the offending value and what to do. The engine client translates
httpx errors and engine error bodies the same way, naming the URL or the adapter.
"""

from __future__ import annotations

from tandem.errors import TandemError


class InferenceError(TandemError):
    """Root of every error the inference side raises on purpose."""


class EngineError(InferenceError):
    """The transformers engine refused or failed an operation."""


class InvalidRequest(EngineError):
    """A request carries a value the engine cannot serve; the message names it."""


class AdapterNotLoaded(EngineError):
    """A request names an adapter the engine does not hold (SGLang answers 400 too)."""


class AdapterLoadFailed(EngineError):
    """An adapter was refused before or during loading; every other adapter is untouched."""


class WeightsLoadFailed(EngineError):
    """A checkpoint given to /update_weights_from_disk was refused; the old weights keep serving."""


class EngineUnavailable(EngineError):
    """The engine cannot generate now: its memory is released or the model is not loaded."""


class EngineBusy(EngineError):
    """In-flight requests did not finish within the allowed time; nothing was changed."""


# Raised by the engine client (engine_client.py) and the gateway -------------------------


class AdapterLoadError(AdapterLoadFailed):
    """The engine answered a load with an error; the previous version keeps serving."""

    def __init__(
        self, message: str, *, adapter: str | None = None, status_code: int | None = None,
        engine_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.adapter = adapter
        self.status_code = status_code
        self.engine_message = engine_message if engine_message is not None else message


class EngineTimeout(EngineUnavailable):
    """The engine did not answer within the timeout of the call's kind."""


class EngineResponseError(EngineError):
    """The engine answered an error status (or `success: false`); its own message is kept."""

    def __init__(self, message: str, *, status_code: int, engine_message: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.engine_message = engine_message if engine_message is not None else message


class ModelNotFound(InferenceError):
    """A gateway `model` that names no known run, or a version that is not loaded."""

    def __init__(self, message: str, *, known: list[str] | None = None) -> None:
        super().__init__(message)
        self.known = list(known or [])


class Overloaded(InferenceError):
    """The gateway has no room for this request now (settings gateway.max_in_flight_*, queue)."""

    def __init__(self, message: str, *, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        """`queue_full` (refused at once) or `queue_timeout` (waited `gateway.queue_timeout_s`)."""
        self.retry_after_s = retry_after_s
