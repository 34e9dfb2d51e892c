"""One log format for every service: a timestamp, the level, the logger, one event per line.

`configure()` is what each service's `main` calls first. The level is `TANDEM_LOG_LEVEL`
(`INFO` by default; `DEBUG`, `WARNING`, ...). Python warnings go through logging (with their
category on one line), and uvicorn, given `log_config=None`, logs through the same handler,
so its access lines carry the timestamp too. `QuietPolls` keeps the access log for requests:
the successful health checks, readiness probes and scrapes that a controller, a router or
Prometheus sends every few seconds are left out of it (failures are still logged).

A message is one line whatever it carries: control characters in it (a run name, an rq job's
description or anything else read from Redis or a request) are written escaped (`\n`, `\x1b`),
so no value can forge a log line or a terminal sequence; a traceback keeps its lines. asyncio's
"socket.accept() out of system resource" (a flood of connections past the open-file limit) is
logged once a minute with the count left out, not once per accept retry with its traceback.
"""

from __future__ import annotations

import logging
import os
import time

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


#: Control characters (C0, DEL, C1 and the Unicode line and paragraph separators) as written in a message.
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]} | {
    ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def one_line(text: str) -> str:
    """`text` with its control characters escaped: one line, no terminal sequences."""
    return text.translate(_ESCAPES)


class OneLineFormatter(logging.Formatter):
    """FORMAT with the message on one line (one_line); the traceback after it as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


class Throttled(logging.Filter):
    """Lets one record whose message starts with `prefix` through every `every_s` seconds, without
    its traceback, saying how many were left out since the last."""

    def __init__(self, prefix: str, every_s: float) -> None:
        super().__init__()
        self.prefix, self.every_s = prefix, every_s
        self.last = -float("inf")
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.left_out += 1
            return False
        record.msg = (f"{message.splitlines()[0]} ({self.left_out} more left out since the last; raise the "
                      "open-file limit, or find the client that holds connections open)")
        record.args = ()
        record.exc_info = record.exc_text = None
        self.last, self.left_out = now, 0
        return True


def configure() -> None:
    """Set the root logger's format and level (TANDEM_LOG_LEVEL), route warnings and quiet the polls."""
    raw = os.environ.get(LEVEL_ENV, "INFO").strip().upper() or "INFO"
    level = logging.getLevelName(raw)
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO, handlers=[handler])
    if not isinstance(level, int):
        logging.getLogger(__name__).warning("%s=%r is not a log level (DEBUG, INFO, WARNING, ERROR); using INFO",
                                            LEVEL_ENV, raw)
    logging.captureWarnings(True)
    logging.getLogger("uvicorn.access").addFilter(QuietPolls())
    logging.getLogger("asyncio").addFilter(Throttled("socket.accept() out of system resource", 60.0))
