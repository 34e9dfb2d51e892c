"""LoRA adapters on the base model: what the engine accepts, and peft loading, activating, deleting them.

Everything that can be checked without touching the model is checked first (`check`: the
config through `tandem.adapters.read_adapter_config`, the rank, the target modules, every
tensor's name, shape and values), so a bad adapter never half-loads; if peft still fails,
the partial adapter is removed again and the model is as it was.

peft holds each adapter under an internal name (`tandem_<n>`), never its public one, which only
this module sees: peft makes adapter names keys of torch module dicts, which refuse '.' (and
the names of their own attributes), while public names are `<run>-v<version>` and run names
may contain '.'. Internal names are numbered by load and never reused, so two public names
(`a.b`, `a_b`) never share one, as escaping the '.' could make them.

`LoraAdapters` holds no lock: the runtime (`runtime.HFEngine`) calls `load`, `delete` and
`activated` under its model lock. torch, safetensors and peft are imported inside functions,
so importing this module is cheap.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.adapters import read_adapter_config
from tandem.errors import AdapterRejected
from tandem_inference.engines.transformers.model import Model
from tandem_inference.errors import AdapterLoadFailed, EngineError

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


class LoraAdapters:
    """The adapters peft holds on one model, and the rules an adapter must meet to join them."""

    def __init__(self, model: Model, *, max_lora_rank: int, allowed_targets: Collection[str] | None) -> None:
        self.model = model
        self.max_lora_rank = max_lora_rank
        # Like SGLang's --lora-target-modules: adapters on other modules are refused ("all" = any).
        self.allowed_targets = (
            None if not allowed_targets or "all" in allowed_targets else set(allowed_targets)
        )
        self.peft: PeftModel | None = None
        """The model wrapped by peft while at least one adapter is loaded."""
        self._active: str | None = None  # the internal name of the adapter peft has active
        self._peft_names: dict[str, str] = {}  # public name -> the internal name peft holds it under
        self._loads = 0  # numbers the internal names

    # -- checks, before the model is touched ----------------------------------------------------

    def check(self, directory: Path, prefix: str) -> None:
        """Raise AdapterLoadFailed (message starting with `prefix`) unless the engine can load it."""
        try:
            config = read_adapter_config(directory)
        except AdapterRejected as exc:
            raise AdapterLoadFailed(f"{prefix}: {exc}") from exc
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
        rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
        if rank > self.max_lora_rank:
            raise AdapterLoadFailed(f"{prefix}: rank r={rank} exceeds max_lora_rank={self.max_lora_rank}")
        self._check_targets(config.get("target_modules"), prefix)
        self._check_weights(directory, prefix)

    def _check_targets(self, targets: Any, prefix: str) -> None:
        names = list(self.model.linears)
        if isinstance(targets, str):
            if targets != "all-linear" and not any(re.fullmatch(targets, n) for n in names):
                raise AdapterLoadFailed(
                    f"{prefix}: target_modules {targets!r} matches no module of the base model"
                )
            return
        if not targets:
            raise AdapterLoadFailed(f"{prefix}: target_modules is empty")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise AdapterLoadFailed(f"{prefix}: target_modules {targets!r:.80} is not a list of module names")
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            raise AdapterLoadFailed(f"{prefix}: target modules {missing} do not exist in the base model")

    def _check_weights(self, directory: Path, prefix: str) -> None:
        import torch

        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in _read_weights(directory, prefix).items():
            m = _TENSOR.fullmatch(key)
            if m is None or m.group(1) not in self.model.linears:
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
            in_f, out_f = self.model.linears[module]
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

    # -- peft, under the model lock ---------------------------------------------------------------

    def load(self, name: str, directory: Path, prefix: str) -> None:
        """Hand a checked adapter to peft under a new internal name; on failure leave the model as it was.

        The caller has made sure `name` is not loaded (`admission.check_room`).
        """
        from peft import PeftModel

        self._loads += 1
        peft_name = f"tandem_{self._loads}"
        device = self.model.weights_device()  # the CPU while memory is released
        try:
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(
                    self.model.hf, str(directory), adapter_name=peft_name, torch_device=device
                )
                self.peft.eval()
            else:
                self.peft.load_adapter(str(directory), adapter_name=peft_name, torch_device=device)
        except Exception as exc:  # peft and torch raise many types; translate them all
            self._active = None
            if self.peft is None:
                _strip_tuner_layers(self.model.hf)
            elif peft_name in self.peft.peft_config:
                self._delete(peft_name)
            raise AdapterLoadFailed(f"{prefix}: peft could not load it: {exc}") from exc
        self._peft_names[name] = peft_name

    def delete(self, name: str) -> None:
        """Remove `name` from peft; removing the last adapter unwraps the base model again."""
        peft_name = self._peft_names.pop(name, None)
        if peft_name is not None:
            self._delete(peft_name)

    def _delete(self, name: str) -> None:
        """Remove the adapter peft holds under the internal name `name` (see `delete`)."""
        from transformers import PreTrainedModel

        if self.peft is None:
            return
        remaining = [a for a in self.peft.peft_config if a != name]
        if not remaining:  # peft cannot delete the last adapter cleanly: unwrap the base model
            base = self.peft.unload()  # not in place: the unwrapped model is what it returns
            if not isinstance(base, PreTrainedModel):
                raise EngineError(f"peft unwrapped a {type(base).__name__}, not the base model")
            self.model.hf = base
            self.peft = None
        else:
            if self._active == name or self.peft.active_adapter == name:
                self.peft.set_adapter(remaining[0], inference_mode=True)  # avoids peft's warning
            self.peft.delete_adapter(name)
        self._active = None

    def activated(self, name: str | None) -> AbstractContextManager[Any]:
        """Make `name` (None = the base model) the one that calls to the model run, for a block."""
        if self.peft is None:
            return nullcontext()
        if name is None:
            return self.peft.disable_adapter()
        peft_name = self._peft_names[name]
        if self._active != peft_name:
            self.peft.set_adapter(peft_name, inference_mode=True)
            self._active = peft_name
        return nullcontext()


def _read_weights(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if (directory / "adapter_model.safetensors").is_file():
            return load_file(str(directory / "adapter_model.safetensors"))
        if (directory / "adapter_model.bin").is_file():
            loaded = torch.load(directory / "adapter_model.bin", map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
                raise AdapterLoadFailed(f"{prefix}: adapter_model.bin is not a mapping of names to tensors")
            return {str(k): v for k, v in loaded.items()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise AdapterLoadFailed(f"{prefix}: its weights file is unreadable: {exc}") from exc
    raise AdapterLoadFailed(f"{prefix}: no adapter_model.safetensors (or .bin) in {str(directory)!r}")


def _strip_tuner_layers(model: torch.nn.Module) -> None:
    """Put back the original modules wherever peft injected a layer (after a failed first load)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
