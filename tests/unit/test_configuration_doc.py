from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tandem.dev.settings_reference import settings_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_settings() -> None:
    assert DOC.read_text() == settings_markdown(), "regenerate: tandem settings --markdown > docs/configuration.md"


def test_every_setting_is_documented() -> None:
    rows = [line for line in settings_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) > 30
    assert all(not line.rstrip().endswith("|  |") for line in rows), "a setting has no docstring"


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`tandem status | head`: the pipe's reader left, and the command ended in a BrokenPipeError's
    traceback."""
    proc = subprocess.Popen([sys.executable, "-c", "from tandem.dev.cli import main; raise SystemExit(main())",
                             "settings", "--markdown"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before a line is written
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
