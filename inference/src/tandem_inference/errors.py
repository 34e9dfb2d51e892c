"""tandem_inference's errors, one tree under tandem's root.

    TandemError                        (tandem.errors)
    └── InferenceError                 anything the inference side raises on purpose
        ├── EngineError                (engine server) the transformers engine refused or failed an operation
        │   ├── InvalidRequest         a generation request with a bad value (HTTP 400; names it)
        │   ├── AdapterNotLoaded       a request or unload naming an adapter that is not loaded (400)
        │   ├── AdapterLoadFailed      an adapter the engine refuses to load; nothing changed (400)
        │   ├── WeightsLoadFailed      a full-weight checkpoint the engine refuses; the old weights serve (400)
        │   ├── EngineUnavailable      no model to run: memory released or not loaded yet (503)
        │   └── EngineBusy             in-flight requests did not finish in time (503)
        ├── EngineClientError          (engine client) a call to an engine (SGLang or the transformers
        │   │                          engine) failed; the message names the URL
        │   ├── EngineUnreachable      no connection to the engine, or it answered 503 (not ready)
        │   │   └── EngineTimeout      the engine did not answer within the call kind's timeout
        │   └── EngineResponseError    the engine answered an error status (or `success: false`);
        │       │                      carries the status and the engine's own message
        │       ├── AdapterLoadRefused the engine refused to load an adapter; carries its name
        │       └── AdapterMissing     a generation named an adapter the engine does not hold (a
        │                              server fault: unloaded under it, or the engine restarted)
        ├── EngineBootError            (engine launcher) the engine did not become healthy, its port is
        │                              taken, or it died more often than allowed
        ├── ModelNotFound              (gateway) a `model` that names no run or loaded version (404);
        │   │                          carries the known names
        │   └── NotResident            a version of a known run that is not in the engine now (the
        │                              gateway loads it on demand; 404 only where nothing can)
        ├── Overloaded                 (gateway) no room for more generation in flight or in the
        │                              queue (429 with Retry-After); carries the reason
        ├── ClientLeft                 (gateway) the client closed its connection before its response
        │                              started; its engine calls were closed (answered 499)
        ├── TinkerRefusal              (tinker service) a Tinker call refused, answered in Tinker's error
        │   │                          shape (503 itself: the gateway did not answer)
        │   ├── TinkerInvalid          a body that does not fit: a shape, an unknown loss, a bad tensor (422)
        │   ├── TinkerNotFound         an unknown session, model, future, checkpoint or sampling session (404)
        │   └── TinkerUnsupported      a route or option tandem does not serve (404; lists what it serves)
        └── RequestRefused             (gateway) a request refused for a value it asks for (422 unless
            │                          a subclass says otherwise); carries the field at fault
            ├── ContextTooLong         the prompt and the tokens asked for do not fit the context (400)
            └── EpisodeRefused         an episode request that cannot go on (422 for a request
                │                      episodes do not take)
                ├── EpisodeNotFound    the episode is unknown or has expired (404)
                ├── EpisodeConflict    the messages do not continue the episode, or another request
                │                      advanced it first (409)
                └── EpisodeTooLong     the turn would pass gateway.episode_max_tokens (400)

The engine server's branch and the engine client's branch are apart on purpose: the first is
what the transformers engine answers with (and maps to HTTP statuses), the second what tandem
sees when it calls any engine over HTTP. An adapter the transformers engine refuses raises
`AdapterLoadFailed` inside the engine and reaches the controller as `AdapterLoadRefused`.

Errors from torch, transformers and peft are translated where they enter tandem_inference,
with a message that names the offending value and what to do. The engine client translates
httpx errors and engine error bodies (engines/http_errors.py), the launcher OS and process errors,
and Redis errors reach this package only as `tandem.errors.BackendUnavailable` (Registry,
EventStream, Cursor, GpuLease, and `tandem.connection.translated` around the controller's own
Redis calls). The inference side also raises these of the light package's tree on purpose:
`ConfigError` (a gateway exposed without an API key), `AdapterRejected` (a version that fails
the store's checks, turned into an `adapter_rejected` event) and `BackendUnavailable`.
"""

from __future__ import annotations

from tandem.errors import TandemError


class InferenceError(TandemError):
    """Root of every error the inference side raises on purpose."""


# Raised by the transformers engine (tandem_inference.engines.transformers) ------------------------------


class EngineError(InferenceError):
    """The transformers engine refused or failed an operation."""


class InvalidRequest(EngineError):
    """A request carries a value the engine cannot serve; the message names it."""


class AdapterNotLoaded(EngineError):
    """A request names an adapter the engine does not hold (SGLang answers 400 too)."""


class AdapterLoadFailed(EngineError):
    """An adapter was refused before or during loading; every other adapter is untouched."""


class WeightsLoadFailed(EngineError):
    """A full-weight checkpoint was refused; the old weights keep serving."""


class EngineUnavailable(EngineError):
    """The engine cannot generate now: its memory is released or the model is not loaded."""


class EngineBusy(EngineError):
    """In-flight requests did not finish within the allowed time; nothing was changed."""


# Raised by the engine clients (tandem_inference.engines) ---------------------------------


class EngineClientError(InferenceError):
    """A call to the engine over HTTP failed; the message names the URL (and the adapter)."""


class EngineUnreachable(EngineClientError):
    """The engine cannot serve the call now: no connection, or it answered 503 (not ready)."""


class EngineTimeout(EngineUnreachable):
    """The engine did not answer within the timeout of the call's kind."""


class EngineResponseError(EngineClientError):
    """The engine answered an error status (or `success: false`); its own message is kept."""

    def __init__(self, message: str, *, status_code: int, engine_message: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.engine_message = engine_message if engine_message is not None else message


class AdapterLoadRefused(EngineResponseError):
    """The engine answered a load with an error; the previous version keeps serving."""

    def __init__(
        self, message: str, *, adapter: str, status_code: int, engine_message: str | None = None,
    ) -> None:
        super().__init__(message, status_code=status_code, engine_message=engine_message)
        self.adapter = adapter


class AdapterMissing(EngineResponseError):
    """A generation named an adapter the engine does not hold: tandem's fault, not the client's."""


# Raised by the engine launcher (engines/launcher.py) --------------------------------------


class EngineBootError(InferenceError):
    """SGLang did not become healthy, its port is taken, or it crashed more often than allowed."""


# Raised by the gateway (tandem_inference.gateway) -----------------------------------------


class ModelNotFound(InferenceError):
    """A gateway `model` that names no known run, or a version that is not loaded."""

    def __init__(self, message: str, *, known: list[str] | None = None) -> None:
        super().__init__(message)
        self.known = list(known or [])


class NotResident(ModelNotFound):
    """A version of a known run that is not loaded in the engine now: evicted for room, retired,
    or never loaded here. The gateway has the controller load it on demand (when the registry has
    it); without a controller it is a 404 like any other unknown version."""

    def __init__(self, message: str, *, run: str, version: int, known: list[str] | None = None) -> None:
        super().__init__(message, known=known)
        self.run = run
        self.version = version


class Overloaded(InferenceError):
    """The gateway has no room for this request now (settings gateway.max_in_flight_*, queue)."""

    def __init__(self, message: str, *, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        """`queue_full` (refused at once), `queue_timeout` (waited `gateway.queue_timeout_s`),
        `run_queue_full` / `run_quota_timeout` (beyond the run's own quota: gateway.run_*),
        `run_adapter_slots` (the run's own engine slots, controller.run_max_loaded_adapters, all busy),
        `adapter_slots` (every engine slot held by requests in flight for `controller.slot_wait_s`)
        or `adapter_load` (the engine did not load the version in time)."""
        self.retry_after_s = retry_after_s


class ClientLeft(InferenceError):
    """The client closed its connection before its response started; nobody reads the answer."""


class RequestRefused(InferenceError):
    """A request the gateway refuses for a value it asks for; nothing was generated or changed."""

    status_code = 422

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The request field at fault (OpenAI's `param`)."""


class ContextTooLong(RequestRefused):
    """The prompt and the tokens asked for do not fit in the model's context (OpenAI's 400)."""

    status_code = 400


class EpisodeRefused(RequestRefused):
    """An episode request the gateway refuses; nothing of the episode changed."""


class EpisodeNotFound(EpisodeRefused):
    """No episode under this id: never started, deleted, or expired (gateway.episode_ttl_s)."""

    status_code = 404


class EpisodeConflict(EpisodeRefused):
    """The request's messages do not continue the episode, or another request advanced it first."""

    status_code = 409


class EpisodeTooLong(EpisodeRefused):
    """The turn would make the episode longer than gateway.episode_max_tokens."""

    status_code = 400


class TinkerRefusal(InferenceError):
    """A Tinker call refused, answered in Tinker's error shape (tandem_inference.tinker.replies).

    Statuses 400 and 409 are never used: the SDK retries them (a bare 400 three times, 409 always)."""

    status_code = 503

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TinkerInvalid(TinkerRefusal):
    status_code = 422


class TinkerNotFound(TinkerRefusal):
    status_code = 404


class TinkerUnsupported(TinkerRefusal):
    status_code = 404
