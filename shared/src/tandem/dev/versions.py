"""Adapter versions published the way the trainer publishes them, without a trainer: for the tests
and benchmarks of the inference side, which need many versions of many runs cheaply.

A version is written into a store staging directory (by a function the caller gives: a random
LoRA, or a reseeded copy of one), published with its manifest, registered in the registry, and
announced with `adapter_ready` on the event stream. Registering and announcing are separate steps,
so a caller can publish versions first and let the controller see them later.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tandem.adapters import AdapterStore, Manifest
from tandem.events import Event, EventKind, EventStream
from tandem.registry import Registry


def publish_version(store: AdapterStore, run: str, version: int, *, base_model: str, rank: int,
                    write: Callable[[Path], object], registry: Registry | None = None) -> Manifest:
    """Publish version `version` of `run`, its adapter written by `write(adapter_dir)` into the
    staging directory; registered too where `registry` is given (else the caller registers it
    with `registry.register_version` when the controller may see it)."""
    with store.staging(run, version) as staged:
        write(staged / "adapter")
        manifest = store.publish(
            staged,
            Manifest(run=run, version=version, parent=version - 1, step=version, job_id=f"job-{run}-{version}",
                     base_model=base_model, lora_rank=rank),
        )
    if registry is not None:
        registry.register_version(manifest)
    return manifest


def announce_ready(events: EventStream, store: AdapterStore, manifest: Manifest, *, path: str | None = None) -> str:
    """Append the version's `adapter_ready` as the trainer does (with the adapter's path relative to
    the store's root, or `path`); returns the event's id."""
    rel = str(store.adapter_dir(manifest.run, manifest.version).relative_to(store.root))
    return events.append(
        Event(
            kind=EventKind.ADAPTER_READY,
            run=manifest.run,
            version=manifest.version,
            job_id=manifest.job_id,
            data={
                "path": path if path is not None else rel,
                "step": manifest.step,
                "parent": manifest.parent,
                "metrics": {},
                "published_at": manifest.created_at,
            },
        )
    )
