"""LoRA versions published and announced the way the trainer does it, for the tests of the inference side.

A version is a random LoRA of the tiny model (`build_random_adapter`: nonzero B, so each
version changes the outputs) saved into a store staging directory, published with a
manifest, registered, and announced with `adapter_ready` (`tandem.dev.versions`, which the
benchmarks share).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.adapters import AdapterStore, Manifest
from tandem.dev.versions import announce_ready, publish_version
from tandem.events import EventStream
from tandem.registry import Registry
from tandem_trainer.tiny_model import build_random_adapter, reseed_adapter

ATTENTION_QV = ("q_proj", "v_proj")


def publish(
    store: AdapterStore,
    registry: Registry | None,
    tiny_model: Path,
    run: str,
    version: int,
    *,
    rank: int = 4,
    config_patch: dict[str, Any] | None = None,
    config_text: str | None = None,
    register: bool = True,
) -> Manifest:
    """Publish version `version` of `run` (seeded by the version) and register it unless told not to
    (or without a registry); `config_patch` edits its adapter_config.json, `config_text` replaces it whole."""
    def write(out: Path) -> None:
        adapter = build_random_adapter(tiny_model, out, rank=rank, seed=version, target_modules=ATTENTION_QV)
        config_path = adapter / "adapter_config.json"
        if config_patch:
            config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **config_patch}))
        if config_text is not None:
            config_path.write_text(config_text)

    return publish_version(store, run, version, base_model=str(tiny_model), rank=rank, write=write,
                           registry=registry if register else None)


def publish_reseeded(store: AdapterStore, registry: Registry, template: Path, tiny_model: Path, run: str, version: int,
                     *, seed: int, rank: int = 4) -> Manifest:
    """Publish and register version `version` of `run` as a copy of `template` reseeded from `seed`
    (`reseed_adapter`: new weights in milliseconds, for tests that publish hundreds of versions)."""
    return publish_version(store, run, version, base_model=str(tiny_model), rank=rank, registry=registry,
                           write=lambda adapter: reseed_adapter(template, adapter, seed))


def announce(events: EventStream, store: AdapterStore, manifest: Manifest, *, path: str | None = None) -> str:
    """Append the version's `adapter_ready` (with the adapter's path in the store, or `path`); returns its id."""
    return announce_ready(events, store, manifest, path=path)
