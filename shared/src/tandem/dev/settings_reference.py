"""The configuration reference (docs/configuration.md), generated from the settings classes.

`tandem settings --markdown` prints it; a test checks that the document in the repository is
what it prints, so every setting, its environment variable, type, bounds, default and
docstring are documented exactly once, in `tandem.settings`.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from tandem.settings import SERVICES
from tandem.settings.loading import setting_fields


def _type_name(ann: Any) -> str:
    args = get_args(ann)
    origin = get_origin(ann)
    if origin is Literal:
        return " / ".join(f"`{a}`" for a in args)
    if origin in (list, tuple, set, frozenset):  # set from the environment as JSON: '[0, 1]'
        inner = " or ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"JSON list of {inner}" if inner else "JSON list"
    if origin is dict:
        return "JSON object"
    if args:
        return " or ".join(_type_name(a) for a in args)
    if ann is type(None):
        return "none"
    return ann.__name__ if isinstance(ann, type) else str(ann)


def _bounds(metadata: list[Any]) -> str:
    """The numeric bounds among a field's metadata, as `ge 0, le 3600`."""
    parts = []
    for m in metadata:
        if isinstance(m, Ge):
            parts.append(f"ge {m.ge}")
        elif isinstance(m, Gt):
            parts.append(f"gt {m.gt}")
        elif isinstance(m, Le):
            parts.append(f"le {m.le}")
        elif isinstance(m, Lt):
            parts.append(f"lt {m.lt}")
    return ", ".join(parts)


def _rows(model: type[BaseModel]) -> list[str]:
    rows = []
    for var, path, info in setting_fields(model):
        default = info.get_default(call_default_factory=True)
        shown = "(unset)" if default is None else f"`{default}`"
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if "shown_default" in extra:  # computed where it runs (a host name), not here
            shown = str(extra["shown_default"])
        kind = _type_name(info.annotation)
        bounds = _bounds(info.metadata)
        desc = (info.description or "").replace("\n", " ")
        kind_bounds = f"{kind} ({bounds})" if bounds else kind
        rows.append(f"| `{path}` | `{var}` | {kind_bounds} | {shown} | {desc} |")
    return rows


def settings_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the settings classes."""
    out = [
        "# Configuration",
        "",
        "Generated from `shared/src/tandem/settings/` by `tandem settings --markdown`; a test keeps it in sync.",
        "Every setting is an environment variable with the prefix `TANDEM_` and `__` between sections;",
        "a `.env` file in the working directory is read too, and keys meant for other services are ignored.",
        "Print what a service resolved, secrets redacted, with `tandem settings trainer|inference|client`.",
    ]
    for service, cls in SERVICES.items():
        out += ["", f"## {service}", "", (cls.__doc__ or "").strip(), "",
                "| setting | environment variable | type | default | meaning |", "|---|---|---|---|---|"]
        out += _rows(cls)
    return "\n".join(out) + "\n"
