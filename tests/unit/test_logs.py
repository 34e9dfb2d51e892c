"""tandem.logs: one format for every service, its level from TANDEM_LOG_LEVEL, polls left out of the access log.

configure() changes the root logger and routes warnings through logging, so it runs in a child
process here, as it does in each service's main.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tandem.logs import QuietPolls

SCRIPT = """
import logging, warnings
from tandem import logs
logs.configure()
logging.getLogger("tandem.x").debug("a debug line")
logging.getLogger("tandem.x").info("an info line")
warnings.warn("a warning")
"""


def run(level: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_LOG_LEVEL"}
    if level is not None:
        env["TANDEM_LOG_LEVEL"] = level
    done = subprocess.run([sys.executable, "-W", "default", "-c", SCRIPT], env=env, capture_output=True, text=True,
                          check=True, timeout=60)
    return done.stderr.splitlines()


def test_lines_carry_time_level_and_logger_and_warnings_are_log_lines() -> None:
    lines = run(None)
    info = next(line for line in lines if line.endswith("an info line"))
    assert info.split(" ")[2:4] == ["INFO", "tandem.x"] and info[:4].isdigit()
    assert not [line for line in lines if "a debug line" in line]
    assert [line for line in lines if " WARNING py.warnings " in line and "UserWarning: a warning" in line], lines


def test_the_level_comes_from_tandem_log_level() -> None:
    assert [line for line in run("debug") if line.endswith("a debug line")]
    assert not [line for line in run("WARNING") if "an info line" in line]


def test_a_level_that_is_not_one_is_named_and_info_is_used() -> None:
    lines = run("chatty")
    assert [line for line in lines if "TANDEM_LOG_LEVEL='CHATTY' is not a log level" in line], lines
    assert [line for line in lines if line.endswith("an info line")]


def access(method: str, path: str, status: int) -> logging.LogRecord:
    """uvicorn's access record: client, method, path with query, HTTP version, status."""
    return logging.LogRecord("uvicorn.access", logging.INFO, "h11_impl.py", 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", method, path, "1.1", status), None)


@pytest.mark.parametrize(("method", "path", "status", "kept"), [
    ("GET", "/health", 200, False),
    ("GET", "/metrics?x=1", 200, False),
    ("GET", "/v1/models", 200, False),
    ("GET", "/health", 503, True),  # a failing check is news
    ("POST", "/v1/chat/completions", 200, True),
    ("GET", "/v1/runs/r", 200, True),
])
def test_successful_polls_are_left_out_of_the_access_log(method: str, path: str, status: int, kept: bool) -> None:
    assert QuietPolls().filter(access(method, path, status)) is kept


FORGING = """
import logging
from tandem import logs
logs.configure()
logging.getLogger("tandem.x").info("train.start run=%s job_id=j", "zz\\n2026-01-01 00:00:00,000 INFO forged\\x1b[31m")
try:
    raise ValueError("boom")
except ValueError:
    logging.getLogger("tandem.x").exception("failed run=%s", "a\\rb")
for _ in range(50):
    logging.getLogger("asyncio").error("socket.accept() out of system resource\\nsocket: <s>", exc_info=OSError(24, "x"))
"""


def test_a_value_in_a_message_cannot_forge_a_line_and_a_traceback_keeps_its_lines() -> None:
    done = subprocess.run([sys.executable, "-c", FORGING], capture_output=True, text=True, check=True, timeout=60)
    lines = done.stderr.splitlines()
    start = next(line for line in lines if "train.start" in line)
    assert start.endswith("run=zz\\n2026-01-01 00:00:00,000 INFO forged\\x1b[31m job_id=j")
    assert not [line for line in lines if line.startswith("2026-01-01")] and "\x1b" not in done.stderr
    failed = lines.index(next(line for line in lines if "failed run=a\\rb" in line))
    assert lines[failed + 1] == "Traceback (most recent call last):" and "ValueError: boom" in lines
    floods = [line for line in lines if "socket.accept() out of system resource" in line]
    assert len(floods) == 1 and "(0 more left out since the last" in floods[0]  # once a minute, no traceback
    assert "OSError" not in done.stderr
