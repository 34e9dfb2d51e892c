"""tandem_inference's errors, one tree under tandem's root.

    TandemError                    (tandem.errors)
    └── InferenceError             anything the inference side raises on purpose
        └── EngineError            the transformers engine refused or failed an operation
            ├── InvalidRequest     a generation request with a bad value (HTTP 400; names it)
            ├── AdapterNotLoaded   a request or unload naming an adapter that is not loaded (400)
            ├── AdapterLoadFailed  an adapter the engine refuses to load; nothing changed (400)
            ├── EngineUnavailable  no model to run: memory released or not loaded yet (503)
            └── EngineBusy         in-flight requests did not finish in time (503)

Errors from torch, transformers and peft are translated where they enter tandem_inference,
with a message that names the offending value and what to do.
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


class EngineUnavailable(EngineError):
    """The engine cannot generate now: its memory is released or the model is not loaded."""


class EngineBusy(EngineError):
    """In-flight requests did not finish within the allowed time; nothing was changed."""
