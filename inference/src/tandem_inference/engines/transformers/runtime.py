"""The transformers engine's runtime: one base model, several PEFT LoRA adapters, a sampler.

It exists so that every part of tandem runs the same way with or without SGLang, so it is a
real engine: real forward passes with a KV cache and real adapters, loaded and unloaded by
name while requests run. The HTTP layer (`server` and its routes) only translates shapes.

`HFEngine` ties the parts together: the model (`model`), its adapters (`lora`), which requests
may run (`admission`), the decode loop (`decode`) and the batching of identical requests
(`coalescing`). Model calls are serialized by one lock (callers run them in worker threads);
every generation counts as in flight on its adapter for its whole duration, so that unloading
an adapter and releasing memory wait for it. See `sampling` for what the logprobs are.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem_inference.engines.transformers import weights
from tandem_inference.engines.transformers.admission import Admission
from tandem_inference.engines.transformers.coalescing import Coalescer
from tandem_inference.engines.transformers.decode import Cancel, OnStep, decode
from tandem_inference.engines.transformers.lora import LoraAdapters
from tandem_inference.engines.transformers.model import Model
from tandem_inference.engines.transformers.sampling import SamplingParams, Sequence
from tandem_inference.errors import AdapterLoadFailed, InvalidRequest

log = logging.getLogger(__name__)

Job = tuple[list[int], str | None]
"""One prompt's token ids and the adapter it runs on (None = the base model)."""


class HFEngine:
    """A causal LM with hot-swappable LoRA adapters; thread-safe."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        max_lora_rank: int = 64,
        max_loaded_adapters: int = 8,
        allowed_targets: Collection[str] | None = None,
    ) -> None:
        self.model = Model(model_path, device=device)
        self.lora = LoraAdapters(self.model, max_lora_rank=max_lora_rank, allowed_targets=allowed_targets)
        self.admission = Admission(max_loaded_adapters)
        self.model_lock = threading.Lock()
        """Held by every call that runs, changes or moves the model."""
        self.coalescer = Coalescer(self.model_lock)
        self.batches_run = 0
        self.weight_version = "default"  # reported in meta_info; set by update_weights_from_disk

    # -- state and checks ------------------------------------------------------------------------

    @property
    def adapters(self) -> dict[str, str]:
        """Loaded adapters, name -> path."""
        return self.admission.adapters

    @property
    def released(self) -> bool:
        return self.admission.released

    def check_jobs(self, jobs: list[Job], params: SamplingParams) -> None:
        """Raise now what can be checked before generating (so it is an HTTP error, not a stream event)."""
        if not jobs:
            raise InvalidRequest("empty input: no prompt given")
        for ids, adapter in jobs:
            self.model.check_prompt(ids, params)
            self.admission.check_adapter(adapter)
        self.admission.check_released()

    # -- adapters -----------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> float:
        """Load a PEFT LoRA adapter under `name`; return the seconds it took.

        The adapter is checked before the model is touched, so a bad one never half-loads.
        """
        start = time.perf_counter()
        log.info("adapter_load_start name=%s path=%s", name, path)
        prefix = f"Failed to load LoRA adapter {name}"
        if not name or ":" in name:
            raise AdapterLoadFailed(
                f"{prefix}: names must be non-empty and contain no ':' (OpenAI model fields are split at ':')"
            )
        directory = Path(path)
        if not directory.is_dir():
            raise AdapterLoadFailed(f"{prefix}: {str(path)!r} is not a local directory")
        self.lora.check(directory, prefix)
        with self.model_lock:
            self.admission.check_room(name, prefix)
            self.lora.load(name, directory, prefix)
            self.admission.register(name, str(path))
        seconds = time.perf_counter() - start
        log.info("adapter_load_end name=%s duration_ms=%.1f", name, seconds * 1000)
        return seconds

    def unload_adapter(self, name: str, *, timeout_s: float = 30.0) -> None:
        """Unregister `name` at once, wait for its in-flight requests, then free it."""
        start = time.perf_counter()
        with self.admission.unregistered(name, timeout_s=timeout_s), self.model_lock:
            self.lora.delete(name)
        log.info("adapter_unload_end name=%s duration_ms=%.1f", name, (time.perf_counter() - start) * 1000)

    # -- full weights ---------------------------------------------------------------------------

    def update_weights_from_disk(self, path: str | Path, *, weight_version: str | None = None) -> float:
        """Load a checkpoint of the same architecture into the base model in place; return seconds.

        The checkpoint is read and checked first (see `weights`), without blocking generation;
        then the values are copied while no batch runs, so every request runs wholly on the old
        or wholly on the new weights. Loaded adapters stay loaded.
        """
        start = time.perf_counter()
        log.info("weights_update_start path=%s", path)
        tensors = weights.read_checkpoint(path, self.model.hf)
        with self.model_lock:
            weights.copy_into(self.model.hf, tensors)
            self.model.path = str(path)
            if weight_version is not None:
                self.weight_version = weight_version
        seconds = time.perf_counter() - start
        log.info("weights_update_end path=%s tensors=%d duration_ms=%.1f", path, len(tensors), seconds * 1000)
        return seconds

    # -- requests in flight and memory ------------------------------------------------------------

    @contextmanager
    def in_flight(self, adapter: str | None) -> Iterator[None]:
        """Count one request on `adapter` (None = base) for a block: unload and release wait for it."""
        with self.admission.in_flight(adapter):
            yield

    def release(self, *, timeout_s: float = 300.0) -> None:
        """Refuse new requests, wait for in-flight ones, then move the weights off the GPU."""
        start = time.perf_counter()
        if not self.admission.refuse_all(timeout_s=timeout_s):
            return
        with self.model_lock:
            if self.admission.released:  # unless a resume came in between
                self.model.offload()
        log.info(
            "memory_released device=%s duration_ms=%.1f", self.model.device, (time.perf_counter() - start) * 1000
        )

    def resume(self) -> None:
        """Move the weights back (on CUDA) and accept requests again."""
        start = time.perf_counter()
        with self.model_lock:
            self.model.restore()
            self.admission.accept_all()
        log.info(
            "memory_resumed device=%s duration_ms=%.1f", self.model.device, (time.perf_counter() - start) * 1000
        )

    # -- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
        *,
        on_step: OnStep | None = None,
        cancel: threading.Event | None = None,
    ) -> list[Sequence]:
        """Sample `params.n` continuations of one prompt as one batch; returns them in order.

        `on_step(sequences)` runs after every decode step (text kept current for it); `cancel`
        ends every unfinished sequence with finish_reason "abort". Unseeded requests without
        `on_step` that wait for the model with the same prompt, adapter and settings are run as
        one batch (see `coalescing`).
        """
        params.check()
        self.model.check_prompt(prompt_ids, params)
        if params.max_new_tokens == 0:
            return [Sequence(len(prompt_ids), finish_reason="length") for _ in range(params.n)]
        with self.admission.in_flight(adapter):
            if on_step is None and params.seed is None:
                key = (adapter, tuple(prompt_ids), dataclasses.replace(params, n=1))
                return self.coalescer.run(
                    key,
                    params.n,
                    cancel,
                    lambda rows, batch_cancel: self._run(
                        prompt_ids, dataclasses.replace(params, n=rows), adapter, None, batch_cancel
                    ),
                )
            with self.model_lock:
                return self._run(prompt_ids, params, adapter, on_step, cancel)

    def _run(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        on_step: OnStep | None,
        cancel: Cancel | None,
    ) -> list[Sequence]:
        """One batched generation; the caller holds the model lock and counts it in flight."""
        self.batches_run += 1
        with self.lora.activated(adapter):
            return decode(self.model, prompt_ids, params, on_step, cancel)
