"""One log format for every service: a timestamp, the level, the logger, one event per line.

`configure()` is what each service's `main` calls first. The level is `TANDEM_LOG_LEVEL`
(`INFO` by default; `DEBUG`, `WARNING`, ...). Python warnings go through logging (with their
category on one line), and uvicorn, given `log_config=None`, logs through the same handler,
so its access lines carry the timestamp too. `QuietPolls` keeps the access log for requests:
the successful health checks, readiness probes and scrapes that a controller, a router or
Prometheus sends every few seconds are left out of it (failures are still logged).
"""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
LEVEL_ENV = "TANDEM_LOG_LEVEL"
#: Paths that are polled, not used: their successful access lines are left out.
POLLED = frozenset({"/health", "/ready", "/metrics", "/metrics/engine", "/v1/models", "/server_info"})


class QuietPolls(logging.Filter):
    """Drops uvicorn's access line of a successful (< 400) GET of a polled path."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # uvicorn: client, method, path, http version, status
            return True
        _, method, path, _, status = args
        return not (method == "GET" and str(path).split("?", 1)[0] in POLLED
                    and isinstance(status, int) and status < 400)


def configure() -> None:
    """Set the root logger's format and level (TANDEM_LOG_LEVEL), route warnings and quiet the polls."""
    raw = os.environ.get(LEVEL_ENV, "INFO").strip().upper() or "INFO"
    level = logging.getLevelName(raw)
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO, format=FORMAT)
    if not isinstance(level, int):
        logging.getLogger(__name__).warning("%s=%r is not a log level (DEBUG, INFO, WARNING, ERROR); using INFO",
                                            LEVEL_ENV, raw)
    logging.captureWarnings(True)
    logging.getLogger("uvicorn.access").addFilter(QuietPolls())
