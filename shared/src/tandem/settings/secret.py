"""Secrets among the settings: the optional secret type of keys and passwords, and the redaction
of a URL's password for logs, messages and `tandem settings`."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import BeforeValidator, SecretStr


def _unset_if_empty(value: object) -> object:
    return None if isinstance(value, str) and not value.strip() else value


Secret = Annotated[SecretStr | None, BeforeValidator(_unset_if_empty)]
"""An optional secret (a key, a password). Empty or blank is unset, as compose's `${VAR:-}` passes
an unset variable: never a key that an empty `Authorization: Bearer ` header would match."""


def redact_url(url: str) -> str:
    """The URL with its password, if any, shown as '***' (for logs and messages); one that does not
    parse (a bracket left open) is shown as its scheme only, since where its password is is unknown."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return f"{url.split(':', 1)[0][:20]}://*** (does not parse)"
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
