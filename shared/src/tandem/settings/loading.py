"""A service's settings read from the environment, or one line that names each bad variable.

pydantic's own report is several lines per field and names the field (`gateway.port`), not the
variable a person set (`TANDEM_GATEWAY__PORT`); a list or object setting whose value is not JSON
fails even before validation, with a traceback naming only its section. `load` turns both into
a `ConfigError` whose message names the variables, the values (secrets never shown) and what
each needs. A variable of a known section that names no setting of any service
(`TANDEM_GATEWAY__API_KEYS`) is ignored, as pydantic-settings ignores it, but said in a warning
with the setting it may have meant: a misspelt key would otherwise leave a gateway without one.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings
from pydantic_settings.exceptions import SettingsError

from tandem.errors import ConfigError

S = TypeVar("S", bound=BaseSettings)

log = logging.getLogger(__name__)

PREFIX = "TANDEM_"
#: Words of a variable name whose values are never quoted back.
SECRET_WORDS = ("PASSWORD", "KEY", "TOKEN", "SECRET", "URL")


def env_name(loc: tuple[int | str, ...]) -> str:
    """The variable that sets a field at `loc` (`('gateway', 'port')` -> `TANDEM_GATEWAY__PORT`)."""
    return PREFIX + "__".join(str(part).upper() for part in loc if not isinstance(part, int))


def shown(name: str, value: object) -> str:
    """A variable's value as a message may show it: secrets (and URLs, which carry passwords) not."""
    return "(value not shown)" if any(word in name for word in SECRET_WORDS) else f"{value!r:.80}"


def load(cls: type[S]) -> S:
    """`cls()` from the environment and `.env`, or ConfigError naming every variable it refuses."""
    try:
        settings = cls()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = env_name(tuple(error["loc"]))
            given = "" if error["type"] == "missing" else f"={shown(name, error.get('input'))}"
            problems.append(f"{name}{given}: {error['msg']}")
        raise ConfigError(f"invalid {cls.__name__}: {'; '.join(problems)}; fix or unset "
                          f"{'it' if len(problems) == 1 else 'them'} (`tandem settings --markdown` lists every "
                          "setting, its type and bounds)") from None
    except SettingsError as exc:
        section = str(exc).split('"')[1] if str(exc).count('"') >= 2 else ""
        raise ConfigError(f"invalid {cls.__name__}: {_not_json(section) or exc}; a list or object setting "
                          "takes JSON, e.g. TANDEM_GPUS__INFERENCE='[0]' or "
                          "TANDEM_ENGINE__EXTRA_ARGS='[\"--flag\", \"value\"]'") from None
    for name, meant in unknown_variables():
        log.warning("%s names no setting of any tandem service and is ignored%s", name,
                    f"; did you mean {meant}?" if meant else "")
    return settings


def setting_fields(model: type[BaseModel], env: str = PREFIX, path: str = "") -> Iterator[tuple[str, str, FieldInfo]]:
    """(environment variable, dotted path, field) of each setting of `model`, its sections walked into."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from setting_fields(ann, f"{env}{name.upper()}__", f"{path}{name}.")
        else:
            yield f"{env}{name.upper()}", f"{path}{name}", info


def service_arguments(prog: str, service: str, summary: str, argv: list[str] | None = None,
                      flags: dict[str, str] | None = None) -> argparse.Namespace:
    """A service command's arguments, before anything starts: `--help` says what it is and what
    configures it (the TANDEM_ variables, not arguments), `flags` (name: help) are its switches,
    and anything else is a usage error naming it (exit 2). `tandem-engine --help` used to load the
    model and serve."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{summary}\n\nConfigured by TANDEM_ environment variables (and a .env file), not "
                    f"arguments: `tandem settings {service}` prints them resolved, secrets hidden; "
                    "`tandem settings --markdown` lists every setting with its type and bounds.")
    for flag, text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def unknown_variables() -> list[tuple[str, str | None]]:
    """(variable, the setting it may have meant) for each TANDEM_<SECTION>__<NAME> in the environment
    whose section is a settings section and whose name is no setting of it in any service."""
    from tandem.settings.root import SERVICES

    known = {var for cls in SERVICES.values() for var, _, _ in setting_fields(cls)}
    sections = {name.split("__", 1)[0] + "__" for name in known if "__" in name}
    found = []
    for name in sorted(os.environ):
        upper = name.upper()
        section = upper.split("__", 1)[0] + "__"
        if "__" in upper and section in sections and upper not in known:
            rest = {k[len(section):]: k for k in known if k.startswith(section)}  # the section's own names
            close = difflib.get_close_matches(upper[len(section):], sorted(rest), n=1, cutoff=0.75)
            found.append((name, rest[close[0]] if close else None))
    return found


def _not_json(section: str) -> str:
    """The variables of `section` whose values look like JSON lists or objects but do not parse,
    or whose section wants JSON and got a bare word: named with their values."""
    head = f"{PREFIX}{section.upper()}"
    found = []
    for name, value in sorted(os.environ.items()):
        if not name.upper().startswith(head):
            continue
        try:
            json.loads(value)
        except ValueError:
            found.append(f"{name}={shown(name.upper(), value)} is not JSON")
    return "; ".join(found)
