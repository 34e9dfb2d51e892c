"""Reading the compose files as YAML in unit tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


class ComposeTags(yaml.SafeLoader):
    """Reads compose's `!reset` / `!override` tags as plain values (None)."""


ComposeTags.add_multi_constructor("!", lambda loader, suffix, node: None)


def services(name: str) -> dict[str, Any]:
    """The `services` of the compose file `name` at the repository's root."""
    return yaml.load((ROOT / name).read_text(), Loader=ComposeTags)["services"]  # noqa: S506 - SafeLoader plus tags
