"""The transformers + peft backend: LoRA training on CPU or CUDA.

The base model is loaded once per base-model name and stays resident; runs switch by
swapping only the LoRA layers (unload, then inject the run's config). When the adapter in
memory already is the requested run at the requested version -- the common case, where a
worker trains the same run step after step -- nothing is reloaded from disk, so a step
costs one forward/backward per micro-batch and no I/O besides the publish. The runs trained
before stay in memory too (resident.py): switching back to one of them reads nothing either.

Adapters are written as plain PEFT files (adapter_config.json + adapter_model.safetensors,
rslora off, no modules_to_save, no tokenizer files), the one format SGLang and the
transformers engine both hot-load.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from pathlib import Path
from typing import Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from pydantic import JsonValue
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tandem.runs import RunSpec
from tandem_trainer.adapter_files import HostBuffers, StagedAdapter
from tandem_trainer.backends.base import (
    Backend,
    Forward,
    ModelInfo,
)
from tandem_trainer.backends.peft_files import read_version, write_trainer_state
from tandem_trainer.backends.resident import Outcome, ResidentBudget, ResidentRun, ResidentRuns, ResidentStats, Stamp, stamp
from tandem_trainer.errors import CheckpointError, TrainStepFailed
from tandem_trainer.grpo import selective_logprobs, token_entropy
from tandem_trainer.microbatch import MicroBatch
from tandem_trainer.turns import turn_start

log = logging.getLogger(__name__)

#: The adapter dtypes `backend.adapter_dtype` may name (`auto`: the dtype the model trains in).
AdapterDtype = Literal["float32", "auto", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PeftBackend(Backend):
    name = "peft"

    def __init__(self, device: str = "cpu", *, gradient_checkpointing: bool = False,
                 adapter_dtype: AdapterDtype = "float32", resident: ResidentBudget | None = None,
                 gather_copy: bool = False) -> None:
        self.device = torch.device(device)
        self.gradient_checkpointing = gradient_checkpointing and self.device.type == "cuda"
        self.dtype = torch.float32
        if self.device.type == "cuda" and torch.cuda.is_bf16_supported():
            self.dtype = torch.bfloat16
        self.adapter_dtype = self.dtype if adapter_dtype == "auto" else DTYPES[adapter_dtype]
        """Dtype of the published adapter; the float32 master weights go into the trainer state."""
        self._infos: dict[str, ModelInfo] = {}
        self._base_name: str | None = None
        self._base: PreTrainedModel | None = None
        self._model: PeftModel | None = None  # wraps _base while an adapter is active
        self._spec: RunSpec | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        self._active: tuple[str, int, str, str] | None = None
        self._stamp: Stamp | None = None
        """The active version's manifest (resident.stamp) when memory was known to equal its files."""
        self._gradient_jobs: list[str] = []
        """The jobs whose gradients the active adapter's parameters hold (`hold_gradients`)."""
        self._resident = ResidentRuns(self.device, resident or ResidentBudget())
        self._host = HostBuffers(self.device, gather=gather_copy)
        self._file_keys: tuple[list[tuple[str, torch.nn.Parameter]], dict[str, torch.nn.Parameter]] | None = None
        """(the `_params` it was made for, the adapter file's key -> the parameter it holds)."""

    # model ------------------------------------------------------------------
    def model_info(self, base_model: str) -> ModelInfo:
        if base_model not in self._infos:
            try:
                config = AutoConfig.from_pretrained(base_model)
            except (OSError, ValueError) as exc:
                raise CheckpointError(
                    f"cannot read the config of base model {base_model!r}: {exc}; "
                    "give a local path or a hub id the trainer can reach"
                ) from exc
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            pad = getattr(text, "pad_token_id", None)
            if pad is None:
                eos = getattr(text, "eos_token_id", None)
                pad = eos[0] if isinstance(eos, list) else eos
            start = _turn_start(base_model)
            self._infos[base_model] = ModelInfo(
                base_model=base_model,
                vocab_size=int(text.vocab_size),
                max_positions=int(getattr(text, "max_position_embeddings", None) or 1 << 30),
                pad_id=int(pad or 0),
                turn_start_id=start[0] if start else None,
                turn_start=start[1] if start else "",
            )
        return self._infos[base_model]

    def _ensure_base(self, base_model: str) -> None:
        if self._base_name == base_model:
            return
        self._drop_all()
        started = time.perf_counter()
        log.info("base.load.start base_model=%s device=%s dtype=%s", base_model, self.device, self.dtype)
        try:
            model = self._load_base(base_model)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot load base model {base_model!r}: {exc}") from exc
        self._base, self._base_name = model, base_model
        log.info(
            "base.load.end base_model=%s duration_s=%.3f", base_model, time.perf_counter() - started
        )

    def _load_base(self, base_model: str) -> PreTrainedModel:
        """Load the base model onto the device, frozen, ready for LoRA."""
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(base_model, dtype=self.dtype)
        # NOTE: transformers 5.23 wraps PreTrainedModel.to in functools.wraps, which hides from
        # mypy that it is a bound method.
        model.to(self.device)  # type: ignore[arg-type]
        model.requires_grad_(False)
        model.config.use_cache = False
        if self.gradient_checkpointing:
            # transformers leaves these two untyped
            model.gradient_checkpointing_enable(  # type: ignore[no-untyped-call]
                gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()  # type: ignore[no-untyped-call]
        return model

    def _wrap(self, spec: RunSpec, config: LoraConfig) -> PeftModel:
        """Put fresh LoRA layers (seeded by the caller) on the base model."""
        assert self._base is not None, "the base model is loaded before an adapter is put on it"
        return get_peft_model(self._base, config)

    def _drop_adapter(self) -> None:
        """Take the LoRA layers out of the base model (without merging them).

        `unload` restores the base model object that `_wrap` wrapped, in place.
        """
        self.drop_gradients("the run's adapter is replaced (another version of it, or another base model)")
        if self._model is not None:
            self._model.unload()
            if self._base is not None and hasattr(self._base, "peft_config"):
                del self._base.peft_config
        self._model, self._optimizer, self._params, self._spec, self._active = None, None, [], None, None

    def _drop_all(self) -> None:
        self._drop_adapter()
        self._resident.clear("the base model changes")
        self._host.clear()
        self._base, self._base_name = None, None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # adapter ------------------------------------------------------------------
    def activate(self, spec: RunSpec, version: int, version_dir: Path | None) -> bool:
        key = (spec.name, version, spec.model_dump_json(), str(version_dir))
        if self._active == key and self._model is not None:
            return False
        started = time.perf_counter()
        entry = self._resident.take(key, version_dir)
        if self._base_name == spec.base_model:
            self._set_aside(spec.name)
        self._ensure_base(spec.base_model)
        model = self._model if entry is not None and self._layers_fit(spec, entry) else None
        if model is not None:  # a resident run into the same LoRA layers: its tensors become theirs
            self.drop_gradients("the run's adapter is replaced by a resident run's")
        else:
            self._drop_adapter()
            model = self._fresh_layers(spec)
        model.train()  # what gradient checkpointing keys on...
        for name, module in model.named_modules():  # ...but the base model's own dropout stays off:
            if isinstance(module, torch.nn.Dropout) and "lora_dropout" not in name:
                module.eval()  # it would make the ratio to the rollout policy noisy (only LoRA's is wanted)
        self._model, self._spec = model, spec
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = spec.optimizer
        self._optimizer = torch.optim.AdamW(
            [p for _, p in self._params], lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        outcome = self._resident.restore(entry, self._params, self._optimizer) if entry else None
        self._stamp = entry.stamp if entry and outcome else None
        self._gradient_jobs = list(entry.gradient_jobs) if entry and outcome else []
        outcome = outcome or self._read(spec, version, version_dir)
        self._active = key
        self._resident.switches[outcome] += 1
        log.info(
            "adapter.activate run=%s version=%d loaded=%s resident=%s duration_s=%.3f",
            spec.name, version, version_dir is not None, outcome, time.perf_counter() - started,
        )
        return True

    def _layers_fit(self, spec: RunSpec, entry: ResidentRun) -> bool:
        """Whether the LoRA layers on the model now can take the resident run's tensors as they are
        (same base and LoRA config): then switching runs moves tensors in, with no layers rebuilt."""
        return (self._model is not None and self._spec is not None and self._spec.lora == spec.lora
                and self._base_name == spec.base_model and self._resident.fits(entry, self._params))

    def _fresh_layers(self, spec: RunSpec) -> PeftModel:
        """New LoRA layers of the run's config on the base model, seeded by the run."""
        config = LoraConfig(
            r=spec.lora.r,
            # peft annotates lora_alpha as int, but scales by alpha / r in float; a run's may be 12.5
            lora_alpha=spec.lora.alpha,  # type: ignore[arg-type]
            lora_dropout=spec.lora.dropout,
            target_modules=list(spec.lora.target_modules),
            use_rslora=False,
            bias="none",
            task_type="CAUSAL_LM",
        )
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(spec.seed)  # same seed, same fresh adapter
            try:
                return self._wrap(spec, config)
            except ValueError as exc:  # e.g. a target module the model does not have
                raise CheckpointError(f"run {spec.name!r}: cannot apply its LoRA config: {exc}") from exc

    def _set_aside(self, next_run: str) -> None:
        """Keep the training run's state when it is a published version's (or version 0 holding
        gradients) and another run comes; its accumulated gradients go with it."""
        if not (self._active and self._optimizer and self._stamp and self._active[0] != next_run):
            return
        if self._active[1] == 0 and not self._gradient_jobs:
            return  # a fresh adapter is made again at no cost
        self._resident.keep(self._active, self._stamp, self._params, self._optimizer, tuple(self._gradient_jobs))
        self._gradient_jobs = []

    def _read(self, spec: RunSpec, version: int, version_dir: Path | None) -> Outcome:
        """The run's state at `version` from its files into the fresh layers (none at version 0)."""
        self._stamp = stamp(version_dir)  # before reading (resident.FRESH for version 0)
        if version_dir is None:
            return "fresh"
        self._load(spec, version, version_dir)
        return "miss"

    def _load(self, spec: RunSpec, version: int, version_dir: Path) -> None:
        assert self._optimizer is not None
        read_version(self._require_model(), self._optimizer, [n for n, _ in self._params], spec, version,
                     version_dir, self.device)

    # training -----------------------------------------------------------------
    def _logits(self, batch: MicroBatch) -> torch.Tensor:
        out = self._require_model()(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            logits_to_keep=batch.logits_to_keep,
            use_cache=False,
        )
        logits: torch.Tensor = out.logits
        return logits[:, :-1]

    def forward(self, batch: MicroBatch, *, entropy: bool = False) -> Forward:
        logits = self._logits(batch)
        logprobs = selective_logprobs(logits, batch.targets, batch.temperatures)
        return Forward(logprobs=logprobs, entropy=token_entropy(logits, batch.temperatures) if entropy else None)

    def reference_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        model = self._require_model()
        with torch.no_grad(), model.disable_adapter():
            return selective_logprobs(self._logits(batch), batch.targets, batch.temperatures)

    def step(self, max_grad_norm: float) -> float:
        assert self._optimizer is not None
        self._active = None  # the weights no longer equal any published version
        self._gradient_jobs = []  # applied below, or dropped with the step
        params = [p for _, p in self._params]
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        if not torch.isfinite(torch.tensor(norm)):
            self._optimizer.zero_grad(set_to_none=True)
            raise TrainStepFailed(f"gradient norm is {norm}; the step was skipped")
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        return norm

    def gradient_jobs(self) -> list[str]:
        return list(self._gradient_jobs)

    def hold_gradients(self, job_id: str) -> None:
        assert self._model is not None, "gradients are held by an active adapter"
        self._gradient_jobs.append(job_id)

    def drop_gradients(self, why: str) -> list[str]:
        dropped, self._gradient_jobs = self._gradient_jobs, []
        for _, p in self._params:  # (Unsloth reuses the parameters for the next adapter)
            p.grad = None
        if dropped:
            run = self._active[0] if self._active else (self._spec.name if self._spec else "?")
            log.warning("gradients.dropped run=%s jobs=%s why=%s", run, dropped, why)
        return dropped

    def set_adam(self, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        assert self._optimizer is not None
        for group in self._optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def reset_optimizer(self) -> None:
        assert self._optimizer is not None
        self._optimizer.state.clear()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self._params]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stage_adapter(self) -> StagedAdapter:
        model, spec = self._require_model(), self._spec
        assert spec is not None
        config = copy.deepcopy(model.peft_config["default"])
        assert isinstance(config, LoraConfig), "the adapter was made from a LoraConfig"
        config.inference_mode = True
        config.base_model_name_or_path = spec.base_model
        if not isinstance(config.target_modules, str | None):  # a set in memory; stable bytes on disk
            config.target_modules = sorted(config.target_modules)
        # into host buffers kept from the last version; with backend.gather_adapter_copy (on by
        # default) the cast matrices are concatenated on the device and cross in one copy: 4.5 ms
        # against 5.4 one a tensor in the Unsloth trainer at 0.5B on an H200 (docs/benchmarks.md)
        tensors = {key: p.detach() for key, p in self._adapter_parameters(model).items()}
        return self._host.stage(tensors, self.adapter_dtype, config)

    def _adapter_parameters(self, model: PeftModel) -> dict[str, torch.nn.Parameter]:
        """The adapter file's keys (peft's `get_peft_model_state_dict`) -> the trainable parameters.

        peft walks the whole model's state dict for that mapping, 15-100 ms a version at the 0.5B
        shape on a CPU core, all of it between the optimizer step and the files; the parameters
        stay the same objects while an adapter is active, so the mapping is made once per
        activation (`_params` is new with each).
        """
        if self._file_keys is None or self._file_keys[0] is not self._params:
            by_storage = {p.data_ptr(): p for _, p in self._params}
            keys = {key: by_storage.get(t.data_ptr()) for key, t in get_peft_model_state_dict(model).items()}
            missing = sorted(key for key, p in keys.items() if p is None)
            if missing:
                raise CheckpointError(f"the adapter's tensors {missing[:3]} are no trainable parameter of the "
                                      "model; it cannot be staged for publishing")
            self._file_keys = (self._params, {key: p for key, p in keys.items() if p is not None})
        return self._file_keys[1]

    def save_state(self, trainer_dir: Path, *, trainer_state: dict[str, JsonValue]) -> None:
        assert self._optimizer is not None
        write_trainer_state(self._require_model(), self._optimizer, self._params, trainer_dir,
                            {**trainer_state, "backend": self.name}, saved_dtype=self.adapter_dtype)

    def mark_active(self, run: str, version: int, version_dir: Path) -> None:
        assert self._spec is not None and self._spec.name == run
        self._active = (run, version, self._spec.model_dump_json(), str(version_dir))
        self._stamp = stamp(version_dir)

    def invalidate(self) -> None:
        self.drop_gradients("the backend was invalidated (a job failed)")
        self._active = None
        self._resident.clear("the backend was invalidated")

    def forget_run(self, run: str) -> bool:
        forgot = self._resident.forget(run)
        training = self._active[0] if self._active else (self._spec.name if self._spec else None)
        if training == run:  # its layers stay on the model until the next run's state replaces them
            self.drop_gradients(f"run {run} was deleted")
            if self._optimizer is not None:
                self._optimizer.state.clear()
            self._active, self._stamp = None, None
            forgot = True
        return forgot

    @property
    def active(self) -> tuple[str, int] | None:
        return (self._active[0], self._active[1]) if self._active else None

    def holds(self, run: str, version: int, version_dir: Path) -> bool:
        return self.active == (run, version) or self._resident.holds(run, version, version_dir)

    def resident_stats(self) -> ResidentStats:
        return self._resident.stats()

    def _require_model(self) -> PeftModel:
        assert self._model is not None, "no adapter is active; call activate() first"
        return self._model


def _turn_start(base_model: str) -> tuple[int, str] | None:
    """The chat template's turn-start token of `base_model` (turns.py), None without a tokenizer."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer for %s (%s); multi-turn trajectories are not checked for messages "
                    "inside trained spans", base_model, exc)
        return None
    return turn_start(tokenizer)
