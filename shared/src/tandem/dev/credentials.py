"""The local stack's secrets: its Redis passwords (the admin's and one per role) and engine admin
key, and private files.

They are made once and kept in the state directory (`secrets.json`, mode 0600), so the URLs of
the stack's Redis change only with its port; one that a `secrets.json` of an older tandem lacks
is made and added, the others kept. Every file that holds one is written readable by this user
only, with no moment of wider access.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

from tandem.acl import Role
from tandem.errors import ConfigError

log = logging.getLogger(__name__)

#: redis_password is the admin's (Redis's `default` user); redis_<role>_password each role's user's.
_SECRETS = ("redis_password", *(f"redis_{role}_password" for role in Role), "engine_admin_key")


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by this user only (0600), with no moment of wider access.

    Raises ConfigError naming `path` when it cannot be written.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        tmp.replace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path} ({exc}); give the stack a state directory it can write "
                          "(`tandem up --state-dir DIR`)") from exc


def load_secrets(path: Path) -> dict[str, str]:
    """The stack's Redis passwords and engine admin key: read from `path`, each made once if missing.

    Delete the file (with the stack stopped) to rotate them all; the next `tandem up` makes new ones.
    """
    kept: dict[str, str] = {}
    try:
        data = json.loads(path.read_text())
        if path.stat().st_mode & 0o077:
            log.warning("%s was readable by other users; made it private (0600)", path)
            path.chmod(0o600)
        if isinstance(data, dict):
            kept = {k: data[k] for k in _SECRETS if isinstance(data.get(k), str) and data[k]}
        if len(kept) == len(_SECRETS):
            return kept
        log.warning("%s lacks %s; making them", path, ", ".join(k for k in _SECRETS if k not in kept))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the stack's secrets {path}: {exc}; delete it to make new ones") from exc
    made = {k: kept.get(k) or secrets.token_hex(16) for k in _SECRETS}
    write_private(path, json.dumps(made, indent=2) + "\n")
    return made
