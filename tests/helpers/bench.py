"""The benchmark scenarios (bench/*.py), imported the way `python bench/suite.py` imports them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py, with bench/ on sys.path as the suite has it (scenarios import their siblings)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)
