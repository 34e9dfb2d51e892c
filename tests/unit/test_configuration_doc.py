from __future__ import annotations

from pathlib import Path

from tandem.dev.settings_reference import settings_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_settings() -> None:
    assert DOC.read_text() == settings_markdown(), "regenerate: tandem settings --markdown > docs/configuration.md"


def test_every_setting_is_documented() -> None:
    rows = [line for line in settings_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) > 30
    assert all(not line.rstrip().endswith("|  |") for line in rows), "a setting has no docstring"
