"""Where tandem's state lives, sections every service reads: Redis (jobs, events, the registry) and
the adapter volume; and how long the trainer keeps old versions in it (`retention`)."""

from __future__ import annotations

import re
from pathlib import Path

import redis
from pydantic import BaseModel, Field, field_validator

from tandem.errors import BackendUnavailable, ConfigError
from tandem.settings.secret import Secret, redact_url
from tandem.settings.section import SECTION


class RedisSettings(BaseModel):
    """Where Redis is."""

    model_config = SECTION

    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL (`redis://[user:password@]host:port/db`): each service its own role's Redis user
    (`tandem-client`, `tandem-inference`, `tandem-trainer`; docs/operations.md, "Redis roles")."""
    password: Secret = None
    """Password, if not in the URL."""
    socket_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Timeout of one Redis command, in seconds (blocking reads add their own block time)."""

    def connect(self, *, ping: bool = True, timeout_s: float | None = None) -> redis.Redis:
        """Open a client; raises BackendUnavailable naming the URL when Redis does not answer, and
        ConfigError naming it when it is not a Redis URL or Redis refuses its credentials (both
        found by a PING; `ping=False` leaves it out, for a client whose every use copes with failure).
        `timeout_s` bounds its commands below socket_timeout_s (a scrape, a request's read)."""
        timeout = self.socket_timeout_s if timeout_s is None else min(self.socket_timeout_s, timeout_s)
        try:
            client = redis.Redis.from_url(
                self.url,
                password=self.password.get_secret_value() if self.password else None,
                socket_timeout=timeout,
                socket_connect_timeout=min(timeout, 10.0),
            )
        except ValueError as exc:  # redis-py's answer to a URL it cannot read
            raise ConfigError(
                f"Redis URL {redact_url(self.url)!r} cannot work ({exc}); set TANDEM_REDIS__URL to "
                "redis://[:password@]host:port/db (rediss:// for TLS, unix:///path.sock?db=0)"
            ) from exc
        if not ping:
            return client
        try:
            client.ping()
        except redis.AuthenticationError as exc:  # it answered: the user or password is what is wrong
            raise ConfigError(
                f"Redis at {redact_url(self.url)!r} answers but refuses these credentials ({exc}); make the "
                "user and password in TANDEM_REDIS__URL (redis://USER:PASSWORD@host:port/db, USER this service's "
                "role's, e.g. tandem-client) or TANDEM_REDIS__PASSWORD that of a Redis user, or none where it has none"
            ) from exc
        except redis.RedisError as exc:
            raise BackendUnavailable(
                f"Redis at {redact_url(self.url)!r} does not answer ({exc}); start it or set TANDEM_REDIS__URL"
            ) from exc
        return client


class StoreSettings(BaseModel):
    """The adapter volume."""

    model_config = SECTION

    root: Path = Path(".tandem/adapters")
    """Directory that holds every adapter version; shared by trainer (rw) and inference (ro)."""


#: A pinned version, `run@vN` (or `run@N`).
PINNED_VERSION = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}@v?[1-9][0-9]{0,17}$"


class RetentionSettings(BaseModel):
    """Which old versions the trainer removes from the adapter store (tandem_trainer.store_cleanup)."""

    model_config = SECTION

    keep_versions: int = Field(0, ge=0, le=1_000_000)
    """Versions of each run kept in the store, the newest ones: after each publish the trainer removes
    older versions of the run (directories and registry entries), except those an inference replica
    serves or holds and `pinned`. 0: every version is kept (the store grows by one version per step)."""
    pinned: list[str] = Field(default_factory=list)
    """Versions the retention policy never removes, as `run@vN` (a JSON list: `["digits@v7"]`)."""

    @field_validator("pinned")
    @classmethod
    def _pins(cls, pins: list[str]) -> list[str]:
        for pin in pins:
            if not re.fullmatch(PINNED_VERSION, pin):
                raise ValueError(f"retention.pinned: {pin!r} is no version; name one as run@vN (`digits@v7`)")
        return pins

    def pinned_of(self, run: str) -> set[int]:
        """The pinned versions of `run`."""
        versions = set()
        for pin in self.pinned:
            name, _, version = pin.partition("@")
            if name == run:
                versions.add(int(version.removeprefix("v")))
        return versions
