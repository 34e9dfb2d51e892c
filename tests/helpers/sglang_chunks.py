"""SGLang's generation chunks fed to the gateway's `Output` the way the SGLang engine hands them over."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem_inference.engines.sglang_outputs import SampleFold
from tandem_inference.gateway.outputs import Output


class Fed:
    """An `Output` that takes SGLang's chunks (whole results, cumulative or incremental stream chunks)."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.out = Output()
        self.fold = SampleFold(stops=stops)

    def update(self, chunk: dict[str, Any]) -> tuple[str, int]:
        return self.out.update(self.fold.add(chunk))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)
