"""The Tinker service's refusals, each an HTTP status with a message that names the bad value.

    TinkerRefusal            a 4xx answered in Tinker's error shape ({error, category, route, ...})
    ├── BadRequest           422: a body that does not fit (wrong shape, unknown loss, bad tensor)
    ├── NotFound             404: an unknown session, model, future, checkpoint or sampling session
    └── Unsupported          404: a route or option tandem does not serve (the reply lists what it does)

Status 400 and 409 are avoided on purpose: the SDK retries them (a bare 400 three times, 409 always).
"""

from __future__ import annotations


class TinkerRefusal(Exception):
    status_code = 422

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadRequest(TinkerRefusal):
    status_code = 422


class NotFound(TinkerRefusal):
    status_code = 404


class Unsupported(TinkerRefusal):
    status_code = 404
