"""Counting what the trainer reads of the adapter store (resident runs must read nothing)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import tandem_trainer.backends.peft_files as peft_files
from tandem.adapters import AdapterStore


@contextmanager
def counted_reads(monkeypatch: pytest.MonkeyPatch, store: AdapterStore) -> Iterator[Counter[str]]:
    """Count what the trainer reads of the store: the weights (safetensors), the optimizer state
    (torch.load) and the checks of a version's files before resuming from it."""
    reads: Counter[str] = Counter()

    def counting(name, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            reads[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    with monkeypatch.context() as patch:
        patch.setattr(peft_files, "load_file", counting("weights", peft_files.load_file))
        patch.setattr(torch, "load", counting("optimizer", torch.load))
        patch.setattr(store, "verify", counting("verify", store.verify))
        yield reads
