"""The benchmark modules of bench/, imported as the `bench` package the way its scripts import it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py by its dotted path under bench (`"scenarios.agreement"`, `"hotload.hotload_report"`),
    with the repo root on sys.path as each bench script puts it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"bench.{name}")
