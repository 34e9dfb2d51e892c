"""The examples' stack arguments (tandem.dev.demo): a running stack's gateway with its Redis URL,
from --redis or from TANDEM_REDIS__URL, which keeps the password off the command line (and out
of `ps`)."""

from __future__ import annotations

import argparse

import pytest

from tandem.dev.demo import add_stack_arguments, parse_stack_arguments

URL = "redis://tandem-client:pw@127.0.0.1:6379/0"


def parse(monkeypatch: pytest.MonkeyPatch, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="digits.py")
    add_stack_arguments(parser, out="/tmp/x", run="r", min_rise=0.0)
    monkeypatch.setattr("sys.argv", ["digits.py", "--model", "/models/m", "--tokenizer", "/models/m", *argv])
    return parse_stack_arguments(parser)


def test_the_redis_url_comes_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_REDIS__URL", URL)
    assert parse(monkeypatch, "--gateway", "http://127.0.0.1:8000").redis == URL
    other = "redis://tandem-client:other@127.0.0.1:6380/0"
    assert parse(monkeypatch, "--gateway", "http://127.0.0.1:8000", "--redis", other).redis == other  # the flag wins
    assert parse(monkeypatch).gateway is None  # an exported URL alone starts the local stack, as before


def test_a_gateway_without_any_redis_url_is_refused_naming_both_ways(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TANDEM_REDIS__URL", raising=False)
    with pytest.raises(SystemExit) as exited:
        parse(monkeypatch, "--gateway", "http://127.0.0.1:8000")
    assert exited.value.code == 2
    assert "--gateway and --redis go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(monkeypatch, "--redis", URL)  # a Redis URL without its gateway
    assert "TANDEM_REDIS__URL in the environment" in capsys.readouterr().err
