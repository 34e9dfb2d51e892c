"""What the inference service's log tells about its engine: the command line it started, how long
it took to become healthy, and each shared-mode hand-over of the GPU.

The launcher logs `starting engine: <argv>` (secrets already hidden) and `engine healthy in X s`;
the controller's GPU sharing logs `gpu lent to the trainer: drain_ms=.. release_ms=..` when it
gives the GPU to the trainer (SGLang's release, vLLM's sleep) and `gpu back: lent_ms=..
resume_ms=..` when it has it back (resume, wake-up). One hand-over is such a pair.
bench/suite.py and bench/gpu/gpu_check.py record this beside their numbers, so that the engines'
flags and hand-over times come from the runs themselves.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

HANDOVER_KEYS = ("drain_ms", "release_ms", "lent_ms", "resume_ms")
_FIELD = re.compile(r"(\w+_ms)=([0-9.]+)")


def handovers(log_text: str) -> list[dict[str, float]]:
    """Every completed hand-over in the log, oldest first: drain, release, lent and resume times."""
    out: list[dict[str, float]] = []
    current: dict[str, float] | None = None
    for line in log_text.splitlines():
        if "gpu lent to the trainer" in line:
            current = {k: float(v) for k, v in _FIELD.findall(line)}
        elif "gpu back" in line and current is not None:
            out.append({**current, **{k: float(v) for k, v in _FIELD.findall(line)}})
            current = None
    return out


def handover_summary(records: list[dict[str, float]]) -> dict[str, Any]:
    """p50 and max of each hand-over time, and how many hand-overs there were."""
    s: dict[str, Any] = {"count": len(records)}
    for key in HANDOVER_KEYS:
        values = [r[key] for r in records if key in r]
        s[key] = {"p50": statistics.median(values), "max": max(values)} if values else None
    return s


def record(log_text: str) -> dict[str, Any]:
    """The engine's command line and boot time, and the hand-overs, from one inference log."""
    command = re.findall(r"starting engine: (.*)$", log_text, re.M)
    boot = re.findall(r"engine healthy in ([0-9.]+) s", log_text)
    overs = handovers(log_text)
    return {"engine_command": command[-1].strip() if command else None,  # the last start: a reused --state appends
            "engine_starts": len(command),
            "engine_boot_s": float(boot[-1]) if boot else None,
            "handovers": overs[:200], "handover": handover_summary(overs)}
