"""LoRA versions published and announced the way the trainer does it, for the tests of the inference side.

A version is a random LoRA of the tiny model (`build_random_adapter`: nonzero B, so each
version changes the outputs) saved into a store staging directory, published with a
manifest, registered, and announced with `adapter_ready`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tandem.adapters import AdapterStore, Manifest
from tandem.events import Event, EventKind, EventStream
from tandem.registry import Registry
from tandem_trainer.tiny_model import build_random_adapter

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
    with store.staging(run, version) as staged:
        adapter = build_random_adapter(tiny_model, staged / "adapter", rank=rank, seed=version,
                                       target_modules=ATTENTION_QV)
        config_path = adapter / "adapter_config.json"
        if config_patch:
            config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **config_patch}))
        if config_text is not None:
            config_path.write_text(config_text)
        manifest = store.publish(
            staged,
            Manifest(run=run, version=version, parent=version - 1, step=version, job_id=f"job-{run}-{version}",
                     base_model=str(tiny_model), lora_rank=rank),
        )
    if register and registry is not None:
        registry.register_version(manifest)
    return manifest


def reseeded(template: Path, out: Path, seed: int, *, scale: float = 0.5) -> Path:
    """A copy of the adapter at `template` with every lora_B drawn anew from `seed` (and A kept):
    another adapter of the same shape whose outputs differ, written in milliseconds instead of
    building a peft model (for tests that publish hundreds of versions)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template / "adapter_config.json", out / "adapter_config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(template / "adapter_model.safetensors"))
    for name, tensor in sorted(tensors.items()):
        if "lora_B" in name:
            tensors[name] = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype) * scale
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def publish_reseeded(store: AdapterStore, registry: Registry, template: Path, tiny_model: Path, run: str, version: int,
                     *, seed: int, rank: int = 4) -> Manifest:
    """Publish and register version `version` of `run` as `reseeded(template, seed)`."""
    with store.staging(run, version) as staged:
        reseeded(template, staged / "adapter", seed)
        manifest = store.publish(
            staged,
            Manifest(run=run, version=version, parent=version - 1, step=version, job_id=f"job-{run}-{version}",
                     base_model=str(tiny_model), lora_rank=rank),
        )
    registry.register_version(manifest)
    return manifest


def announce(events: EventStream, store: AdapterStore, manifest: Manifest, *, path: str | None = None) -> str:
    """Append the version's `adapter_ready` (with the adapter's path in the store, or `path`); returns its id."""
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
