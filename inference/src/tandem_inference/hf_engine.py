"""The transformers engine's runtime: one base model, several PEFT LoRA adapters, a sampler.

It exists so that every part of tandem runs the same way with or without SGLang, so it is a
real engine: real forward passes with a KV cache and real adapters, loaded and unloaded by
name while requests run. The HTTP layer (`engine_server`) only translates shapes.

Logprobs: every generated token carries `log_softmax(raw logits)[token]`, the log-probability
under the model's *unscaled* distribution (temperature 1, no top-k/top-p/min-p filtering),
whatever sampling settings chose the token. That is what the trainer recomputes in its
teacher-forced pass, so rollout and trainer logprobs agree (to float error) on the same weights.
Top logprobs (`top_logprobs`, SGLang's `top_logprobs_num`) list the most likely tokens of that
same distribution at each step.

Concurrency: model calls are serialized by one lock (callers run them in worker threads).
Every generation holds a *lease* on its adapter (None = base model) for its whole duration;
unloading an adapter unregisters it at once, then waits until its leases are gone (as SGLang
does), and releasing memory waits until no lease is left.

torch, transformers and peft are imported inside functions, so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem_inference.bodies import MAX_TOP_LOGPROBS
from tandem_inference.errors import (
    AdapterLoadFailed,
    AdapterNotLoaded,
    EngineBusy,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
)
from tandem_inference.stops import first_stop

log = logging.getLogger("tandem_inference.hf_engine")

_NOT_LOADED = "Got LoRA adapter that has never been loaded"  # SGLang's wording, which clients match
MAX_BATCH_ROWS = 64  # most rows one batch may hold: n of one request, or coalesced requests
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler (SGLang's `sampling_params`, validated)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    seed: int | None = None  # None = non-deterministic
    top_logprobs: int = 0  # alternatives listed per token (SGLang's top_logprobs_num), best first

    def check(self) -> SamplingParams:
        """Return self, or raise InvalidRequest naming the first bad value."""
        rules = [
            (self.max_new_tokens >= 0, f"max_new_tokens={self.max_new_tokens} must be >= 0"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k={self.top_k} must be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, f"min_p={self.min_p} must be in [0, 1]"),
            (self.n >= 1, f"n={self.n} must be >= 1"),
            (self.n <= MAX_BATCH_ROWS, f"n={self.n} must be <= {MAX_BATCH_ROWS}; fan larger groups out"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
                f"seed={self.seed} must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
            ),
            (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                f"top_logprobs={self.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
        ]
        for ok, message in rules:
            if not ok:
                raise InvalidRequest(f"sampling_params: {message}")
        return self


@dataclass
class Sequence:
    """One sample: its tokens, their logprobs, its text and why it ended (None while running)."""

    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """Per token, the `params.top_logprobs` most likely tokens as (logprob, id), best first."""
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the eos/stop token id or the stop string


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
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise EngineError("engine.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.model_path = str(model_path)
        self.max_lora_rank = max_lora_rank
        self.max_loaded_adapters = max_loaded_adapters
        # Like SGLang's --lora-target-modules: adapters on other modules are refused ("all" = any).
        self.allowed_targets = (
            None if not allowed_targets or "all" in allowed_targets else set(allowed_targets)
        )
        start = time.perf_counter()
        log.info("model_load_start path=%s device=%s", self.model_path, self.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load base model {self.model_path!r}: {exc}") from exc
        # peft injects its layers into this very object, so calling it runs the active adapter
        self._hf = model.to(self.device).eval()  # type: ignore[arg-type]
        self._peft: Any = None  # PeftModel while at least one adapter is loaded
        config = self._hf.config
        self.vocab_size = int(self._hf.get_input_embeddings().num_embeddings)
        self.max_context = int(
            getattr(config, "max_position_embeddings", 0) or self.tokenizer.model_max_length
        )
        self.eos_ids = _eos_ids(self.tokenizer, self._hf)
        self._linears = {
            n: (m.in_features, m.out_features)
            for n, m in self._hf.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        self._model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._adapters: dict[str, str] = {}  # name -> path, what requests may use
        self._unloading: set[str] = set()
        self._in_flight: Counter[str | None] = Counter()
        self._active: str | None = None  # adapter peft currently has active
        self._pending: dict[tuple[Any, ...], list[_Ticket]] = {}  # coalescing requests, by key
        self.batches_run = 0
        self.released = False
        self.weight_version = "default"  # reported in meta_info; set by update_weights_from_disk
        log.info(
            "model_load_end path=%s device=%s dtype=%s duration_ms=%.0f",
            self.model_path,
            self.device,
            self.dtype,
            (time.perf_counter() - start) * 1000,
        )

    # -- tokens -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(text))
        except (TypeError, ValueError) as exc:  # text the tokenizer cannot take (a lone surrogate)
            raise InvalidRequest(f"the tokenizer cannot encode this text: {exc}") from exc

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` under the tokenizer's chat template, ready for the reply."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja errors: a message shape the template cannot render
            raise InvalidRequest(f"messages cannot be rendered by the chat template: {exc}") from exc
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, ValueError) as exc:  # text the tokenizer cannot take (a lone surrogate)
            raise InvalidRequest(f"the tokenizer cannot encode these messages: {exc}") from exc

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest for an empty prompt, unknown token ids or a context overflow."""
        if not prompt_ids:
            raise InvalidRequest("empty input: the prompt has no tokens")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_ids) + params.max_new_tokens > self.max_context:
            raise InvalidRequest(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds the "
                f"model's context length {self.max_context}; shorten the prompt or lower max_new_tokens"
            )

    # -- adapters -----------------------------------------------------------------------------

    @property
    def adapters(self) -> dict[str, str]:
        """Loaded adapters, name -> path."""
        with self._cond:
            return dict(self._adapters)

    def check_adapter(self, name: str | None) -> None:
        if name is not None and name not in self.adapters:
            raise AdapterNotLoaded(f"{_NOT_LOADED}: {name!r}; loaded adapters: {sorted(self.adapters)}")

    def load_adapter(self, name: str, path: str | Path) -> float:
        """Load a PEFT LoRA adapter under `name`; return the seconds it took.

        Everything that can be checked without touching the model is checked first (config,
        rank, modules, tensor names, shapes, finite values), so a bad adapter never half-loads;
        if peft still fails, the partial adapter is removed again.
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
        self._validate(directory, prefix)
        with self._model_lock:
            with self._cond:
                if name in self._adapters or name in self._unloading:
                    raise AdapterLoadFailed(f"{prefix} because it is already loaded")
                if len(self._adapters) + len(self._unloading) >= self.max_loaded_adapters:
                    raise AdapterLoadFailed(
                        f"{prefix}: {self.max_loaded_adapters} adapters are loaded already "
                        f"(max_loaded_adapters); unload one first: {sorted(self._adapters)}"
                    )
            self._peft_load(name, directory, prefix)
            with self._cond:
                self._adapters[name] = str(path)
        seconds = time.perf_counter() - start
        log.info("adapter_load_end name=%s duration_ms=%.1f", name, seconds * 1000)
        return seconds

    def unload_adapter(self, name: str, *, timeout_s: float = 30.0) -> None:
        """Unregister `name` at once, wait for its in-flight requests, then free it."""
        start = time.perf_counter()
        with self._cond:
            if name not in self._adapters:
                raise AdapterNotLoaded(
                    f"cannot unload LoRA adapter {name!r}: it is not loaded; "
                    f"loaded adapters: {sorted(self._adapters)}"
                )
            path = self._adapters.pop(name)
            self._unloading.add(name)
            if not self._cond.wait_for(lambda: self._in_flight[name] == 0, timeout=timeout_s):
                self._unloading.discard(name)
                self._adapters[name] = path
                raise EngineBusy(
                    f"LoRA adapter {name!r} is still used by {self._in_flight[name]} "
                    f"request(s) after {timeout_s:g}s; it stays loaded, retry later"
                )
        try:
            with self._model_lock:
                self._peft_delete(name)
        finally:
            with self._cond:
                self._unloading.discard(name)
        log.info("adapter_unload_end name=%s duration_ms=%.1f", name, (time.perf_counter() - start) * 1000)

    def _validate(self, directory: Path, prefix: str) -> None:
        try:
            config = json.loads((directory / "adapter_config.json").read_text())
        except FileNotFoundError:
            raise AdapterLoadFailed(f"{prefix}: no adapter_config.json in {str(directory)!r}") from None
        except (OSError, ValueError) as exc:
            raise AdapterLoadFailed(f"{prefix}: adapter_config.json is unreadable: {exc}") from exc
        problems = [
            (config.get("peft_type") == "LORA", f"peft_type {config.get('peft_type')!r} is not LORA"),
            (not config.get("use_dora"), "DoRA adapters are not supported"),
            (not config.get("modules_to_save"), "modules_to_save is not supported (SGLang skips it)"),
            (not config.get("trainable_token_indices"), "adapters that train tokens are not supported"),
            (config.get("bias", "none") == "none", f"bias={config.get('bias')!r} is not supported"),
            (not config.get("use_rslora"), "use_rslora is not supported (SGLang scales by alpha/r)"),
        ]
        for ok, problem in problems:
            if not ok:
                raise AdapterLoadFailed(f"{prefix}: {problem}")
        ranks = [int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())]
        if max(ranks) > self.max_lora_rank:
            raise AdapterLoadFailed(
                f"{prefix}: rank r={max(ranks)} exceeds max_lora_rank={self.max_lora_rank}"
            )
        self._check_targets(config.get("target_modules"), prefix)
        self._check_weights(directory, prefix)

    def _check_targets(self, targets: Any, prefix: str) -> None:
        names = list(self._linears)
        if isinstance(targets, str):
            if targets != "all-linear" and not any(re.fullmatch(targets, n) for n in names):
                raise AdapterLoadFailed(
                    f"{prefix}: target_modules {targets!r} matches no module of the base model"
                )
            return
        if not targets:
            raise AdapterLoadFailed(f"{prefix}: target_modules is empty")
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            raise AdapterLoadFailed(f"{prefix}: target modules {missing} do not exist in the base model")

    def _check_weights(self, directory: Path, prefix: str) -> None:
        import torch

        tensors = _read_weights(directory, prefix)
        pairs: dict[str, dict[str, Any]] = {}
        for key, tensor in tensors.items():
            m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
            if m is None or m.group(1) not in self._linears:
                raise AdapterLoadFailed(
                    f"{prefix}: tensor {key!r} is not a LoRA A/B weight of a linear module of the base model"
                )
            if self.allowed_targets is not None and m.group(1).rpartition(".")[2] not in self.allowed_targets:
                raise AdapterLoadFailed(
                    f"{prefix}: module {m.group(1)!r} is outside the engine's LoRA target "
                    f"modules {sorted(self.allowed_targets)}"
                )
            pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
        if not pairs:
            raise AdapterLoadFailed(f"{prefix}: the weights file holds no LoRA tensors")
        for module, ab in pairs.items():
            in_f, out_f = self._linears[module]
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None or a.dim() != 2 or b.dim() != 2:
                raise AdapterLoadFailed(f"{prefix}: module {module!r} needs one 2-d lora_A and one lora_B")
            r = a.shape[0]
            if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
                raise AdapterLoadFailed(
                    f"{prefix}: {module!r} lora_A {tuple(a.shape)} / lora_B "
                    f"{tuple(b.shape)} do not fit its shape ({out_f}, {in_f})"
                )
            if r > self.max_lora_rank:
                raise AdapterLoadFailed(
                    f"{prefix}: rank r={r} of {module!r} exceeds max_lora_rank={self.max_lora_rank}"
                )
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterLoadFailed(f"{prefix}: {module!r} holds NaN or inf values")

    def _peft_load(self, name: str, directory: Path, prefix: str) -> None:
        """Hand a validated adapter to peft; on failure leave the model as it was."""
        from peft import PeftModel

        device = str(next(self._hf.parameters()).device)  # the CPU while memory is released
        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(
                    self._hf, str(directory), adapter_name=name, torch_device=device
                )
                self._peft.eval()
            else:
                self._peft.load_adapter(str(directory), adapter_name=name, torch_device=device)
        except Exception as exc:  # peft and torch raise many types; translate them all
            self._active = None
            if self._peft is None:
                _strip_tuner_layers(self._hf)
            elif name in self._peft.peft_config:
                self._peft_delete(name)
            raise AdapterLoadFailed(f"{prefix}: peft could not load it: {exc}") from exc

    def _peft_delete(self, name: str) -> None:
        remaining = [a for a in self._peft.peft_config if a != name]
        if not remaining:  # peft cannot delete the last adapter cleanly: unwrap the base model
            self._hf = self._peft.unload()
            self._peft = None
        else:
            if self._active == name or self._peft.active_adapter == name:
                self._peft.set_adapter(remaining[0], inference_mode=True)  # avoids peft's warning
            self._peft.delete_adapter(name)
        self._active = None

    def _use(self, name: str | None):  # -> context manager
        if self._peft is None:
            return nullcontext()
        if name is None:
            return self._peft.disable_adapter()
        if self._active != name:
            self._peft.set_adapter(name, inference_mode=True)
            self._active = name
        return nullcontext()

    # -- full weights ---------------------------------------------------------------------------

    def update_weights_from_disk(self, path: str | Path, *, weight_version: str | None = None) -> float:
        """Load a checkpoint of the same architecture into the base model in place; return seconds.

        The checkpoint is read and checked first (see `weights`), without blocking generation;
        then the values are copied while no batch runs, so every request runs wholly on the old
        or wholly on the new weights. Loaded adapters stay loaded.
        """
        from tandem_inference import weights

        start = time.perf_counter()
        log.info("weights_update_start path=%s", path)
        tensors = weights.read_checkpoint(path, self._hf)
        with self._model_lock:
            weights.copy_into(self._hf, tensors)
            self.model_path = str(path)
            if weight_version is not None:
                self.weight_version = weight_version
        seconds = time.perf_counter() - start
        log.info("weights_update_end path=%s tensors=%d duration_ms=%.1f", path, len(tensors), seconds * 1000)
        return seconds

    # -- leases and memory ----------------------------------------------------------------------

    @contextmanager
    def lease(self, adapter: str | None) -> Iterator[None]:
        """Hold `adapter` (None = base) for one request: unload and release wait for it."""
        with self._cond:
            if self.released:
                raise EngineUnavailable("engine memory is released; POST /resume_memory_occupation first")
            if adapter is not None and adapter not in self._adapters:
                raise AdapterNotLoaded(
                    f"{_NOT_LOADED}: {adapter!r}; loaded adapters: {sorted(self._adapters)}"
                )
            self._in_flight[adapter] += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight[adapter] -= 1
                if self._in_flight[adapter] <= 0:
                    del self._in_flight[adapter]
                self._cond.notify_all()

    def release(self, *, timeout_s: float = 300.0) -> None:
        """Refuse new requests, wait for in-flight ones, then move the weights off the GPU."""
        import torch

        start = time.perf_counter()
        with self._cond:
            if self.released:
                return
            self.released = True
            if not self._cond.wait_for(lambda: not self._in_flight, timeout=timeout_s):
                self.released = False
                raise EngineBusy(
                    f"{sum(self._in_flight.values())} request(s) still running after "
                    f"{timeout_s:g}s; memory not released"
                )
        with self._model_lock:
            if self.released and self.device.type == "cuda":  # unless a resume came in between
                self._hf.to("cpu")
                if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # ~32 MB per stream on Hopper
                    torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
        log.info(
            "memory_released device=%s duration_ms=%.1f", self.device, (time.perf_counter() - start) * 1000
        )

    def resume(self) -> None:
        """Move the weights back (on CUDA) and accept requests again."""
        start = time.perf_counter()
        with self._model_lock:
            if self.device.type == "cuda":
                self._hf.to(self.device)
            with self._cond:
                self.released = False
        log.info(
            "memory_resumed device=%s duration_ms=%.1f", self.device, (time.perf_counter() - start) * 1000
        )

    # -- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
        *,
        on_step: Callable[[list[Sequence]], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[Sequence]:
        """Sample `params.n` continuations of one prompt as one batch; returns them in order.

        `on_step(sequences)` runs after every decode step (text kept current for it); `cancel`
        ends every unfinished sequence with finish_reason "abort". Unseeded requests without
        `on_step` that wait for the model with the same prompt, adapter and settings are run as
        one batch (clients fan a group of samples out as n identical requests).
        """
        params.check()
        self.check_prompt(prompt_ids, params)
        if params.max_new_tokens == 0:
            return [Sequence(len(prompt_ids), finish_reason="length") for _ in range(params.n)]
        with self.lease(adapter):
            if on_step is None and params.seed is None:
                return self._coalesced(prompt_ids, params, adapter, cancel)
            with self._model_lock:
                return self._run(prompt_ids, params, adapter, on_step, cancel)

    def _coalesced(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        cancel: threading.Event | None,
    ) -> list[Sequence]:
        key = (adapter, tuple(prompt_ids), dataclasses.replace(params, n=1))
        ticket = _Ticket(params.n, cancel)
        with self._cond:
            self._pending.setdefault(key, []).append(ticket)
        with self._model_lock:
            if not ticket.done:  # no other thread ran it while this one waited: run it and its twins
                batch, rest, rows = [ticket], [], ticket.n
                with self._cond:
                    for t in self._pending.pop(key):
                        if t is ticket:
                            continue
                        if rows + t.n <= MAX_BATCH_ROWS:
                            batch.append(t)
                            rows += t.n
                        else:
                            rest.append(t)
                    if rest:
                        self._pending[key] = rest
                try:
                    merged = dataclasses.replace(params, n=rows)
                    seqs = self._run(prompt_ids, merged, adapter, None, _AllSet([t.cancel for t in batch]))
                except EngineError as exc:
                    for t in batch:
                        t.error, t.done = exc, True
                else:
                    for t in batch:
                        t.result, seqs, t.done = seqs[: t.n], seqs[t.n :], True
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    def _run(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        on_step: Callable[[list[Sequence]], None] | None,
        cancel: Any,
    ) -> list[Sequence]:
        """One batched generation; the caller holds the model lock and a lease on `adapter`."""
        import torch

        self.batches_run += 1
        seqs = [Sequence(prompt_tokens=len(prompt_ids)) for _ in range(params.n)]
        try:
            with torch.inference_mode(), self._use(adapter):
                self._decode_loop(prompt_ids, params, seqs, on_step, cancel)
        except EngineError:
            raise
        except Exception as exc:  # torch: NaN probabilities, out of memory; never leave twins waiting
            raise EngineError(f"generation failed on {self.device}: {type(exc).__name__}: {exc}") from exc
        return seqs

    def _decode_loop(
        self,
        prompt_ids: list[int],
        p: SamplingParams,
        seqs: list[Sequence],
        on_step: Callable[[list[Sequence]], None] | None,
        cancel: Any,
    ) -> None:
        import torch
        from transformers import DynamicCache

        gen = torch.Generator(device=self.device)
        gen.manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        want_text = bool(p.stop) or on_step is not None
        cache = DynamicCache(config=self._hf.config)
        ids = torch.tensor([prompt_ids], device=self.device)
        logits = self._hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[
            :, -1
        ]
        if p.n > 1:  # prefill once, then n rows share the prompt's cache
            cache.batch_repeat_interleave(p.n)
            logits = logits.expand(p.n, -1)
        rows = list(range(p.n))  # which sequence each batch row carries
        for step in range(p.max_new_tokens):
            tokens, logprobs, tops = _sample(logits, p, gen)
            keep = []
            for row, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=False)):
                seq = seqs[rows[row]]
                seq.output_ids.append(token)
                seq.logprobs.append(logprob)
                if tops is not None:
                    seq.top_logprobs.append(list(zip(tops[0][row], tops[1][row], strict=True)))
                if want_text:
                    seq.text = self.decode(seq.output_ids)
                if token in stop_ids:
                    seq.finish_reason, seq.matched = "stop", token
                elif p.stop and (hit := first_stop(seq.text, p.stop)) is not None:
                    seq.text = seq.text[: hit[0]]
                    seq.finish_reason, seq.matched = "stop", hit[1]
                elif step == p.max_new_tokens - 1:
                    seq.finish_reason = "length"
                elif cancel is not None and cancel.is_set():
                    seq.finish_reason = "abort"
                else:
                    keep.append(row)
            if on_step is not None:
                on_step(seqs)
            if not keep:
                break
            if len(keep) < len(rows):  # drop finished rows from the batch and the cache
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                tokens = tokens[index]
                rows = [rows[r] for r in keep]
            logits = self._hf(input_ids=tokens[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        for seq in seqs:
            if not isinstance(seq.matched, str):  # text cut at a stop string stays cut
                seq.text = self.decode(seq.output_ids)


@dataclass
class _Ticket:
    """One request waiting to be coalesced with identical ones; filled by whoever runs it."""

    n: int
    cancel: threading.Event | None
    done: bool = False
    result: list[Sequence] | None = None
    error: EngineError | None = None


class _AllSet:
    """Cancels a coalesced batch only once every request in it is cancelled."""

    def __init__(self, events: list[threading.Event | None]) -> None:
        self.events = events

    def is_set(self) -> bool:
        return all(e is not None and e.is_set() for e in self.events)


def _sample(logits: Any, p: SamplingParams, gen: Any) -> tuple[Any, Any, tuple[list[list[float]], list[list[int]]] | None]:
    """Draw one token per row; return (tokens, their logprobs under the raw distribution, and
    per row the `p.top_logprobs` best (logprobs, ids) of that distribution, or None)."""
    import torch

    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    tops = None
    if p.top_logprobs:
        best = raw.topk(min(p.top_logprobs, raw.shape[-1]), dim=-1)
        tops = (best.values.tolist(), best.indices.tolist())
    if p.temperature < 1e-6:
        tokens = logits.argmax(dim=-1)
    else:
        scores = logits / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            ordered = ordered.masked_fill(probs.cumsum(dim=-1) - probs > p.top_p, float("-inf"))
            scores = torch.empty_like(scores).scatter_(-1, order, ordered)
        if p.min_p > 0:
            probs = scores.softmax(dim=-1)
            scores = scores.masked_fill(
                probs < p.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf")
            )
        tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=gen).squeeze(-1)
    return tokens, raw.gather(-1, tokens[:, None]).squeeze(-1), tops


def _eos_ids(tokenizer: Any, model: Any) -> set[int]:
    """Every id that ends a reply: the tokenizer's eos plus those of the model's configs."""
    ids: set[int] = set()
    for value in (
        tokenizer.eos_token_id,
        getattr(model.generation_config, "eos_token_id", None),
        model.config.eos_token_id,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _read_weights(directory: Path, prefix: str) -> dict[str, Any]:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if (directory / "adapter_model.safetensors").is_file():
            return load_file(str(directory / "adapter_model.safetensors"))
        if (directory / "adapter_model.bin").is_file():
            return dict(torch.load(directory / "adapter_model.bin", map_location="cpu", weights_only=True))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise AdapterLoadFailed(f"{prefix}: its weights file is unreadable: {exc}") from exc
    raise AdapterLoadFailed(f"{prefix}: no adapter_model.safetensors (or .bin) in {str(directory)!r}")


def _strip_tuner_layers(model: Any) -> None:
    """Put back the original modules wherever peft injected a layer (after a failed first load)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
