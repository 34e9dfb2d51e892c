"""The inference service refuses to serve the gateway beyond loopback without an API key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.errors import ConfigError
from tandem.settings import GatewaySettings
from tandem_inference.main import check_exposure


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "gateway.example.com"])
def test_beyond_loopback_without_a_key_is_refused_naming_the_address(host: str) -> None:
    with pytest.raises(ConfigError, match=f"{host!r} \\(gateway.host\\).*TANDEM_GATEWAY__API_KEY"):
        check_exposure(GatewaySettings(host=host))
    with pytest.raises(ConfigError):
        check_exposure(GatewaySettings(host=host, api_key=""))  # an empty key is no key


@pytest.mark.parametrize(
    "settings",
    [
        GatewaySettings(host="127.0.0.1"),
        GatewaySettings(host="localhost"),
        GatewaySettings(host="::1"),
        GatewaySettings(host="0.0.0.0", api_key="k"),
        GatewaySettings(host="0.0.0.0", allow_unauthenticated=True),
        GatewaySettings(host="0.0.0.0", published_host="127.0.0.1"),  # compose: published on loopback
    ],
    ids=["loopback", "localhost", "ipv6-loopback", "key", "allowed", "published-on-loopback"],
)
def test_loopback_a_key_or_an_explicit_allowance_starts(settings: GatewaySettings) -> None:
    check_exposure(settings)


def test_the_published_address_counts_in_a_container() -> None:
    with pytest.raises(ConfigError, match="'0.0.0.0' \\(gateway.published_host\\)"):
        check_exposure(GatewaySettings(host="0.0.0.0", published_host="0.0.0.0"))


def test_the_service_exits_at_once_with_one_line_naming_the_fix() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update({"TANDEM_GATEWAY__HOST": "0.0.0.0", "TANDEM_REDIS__URL": "redis://127.0.0.1:1/0"})
    proc = subprocess.run([sys.executable, "-m", "tandem_inference.main"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "TANDEM_GATEWAY__ALLOW_UNAUTHENTICATED" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
