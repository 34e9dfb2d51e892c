"""The Unsloth backend: the peft backend's job logic on Unsloth's fast LoRA kernels (CUDA).

Unsloth patches transformers when it is imported, so this module is imported only when
the backend is chosen, before anything else touches transformers. It loads the base model
with `FastLanguageModel.from_pretrained` and puts LoRA on it with
`FastLanguageModel.get_peft_model` once per LoRA shape; a later run with the same shape
reuses those layers (re-initialised for a fresh run, then overwritten with a version's
weights or given a resident run's tensors), because Unsloth expects to wrap a model once.

Adapters are saved the way the peft backend saves them: plain PEFT files, rslora off, no
modules_to_save, no tokenizer files, so SGLang loads them as they are.
"""

from __future__ import annotations

import logging
import os

# Unsloth skips materialising logits in training forwards unless told to; GRPO needs them.
os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")

import torch  # noqa: E402
import unsloth  # noqa: E402,F401  (must come before transformers)
from peft import LoraConfig, PeftModel  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402
from unsloth import FastLanguageModel  # noqa: E402

from tandem.runs import RunSpec  # noqa: E402
from tandem_trainer.backends.peft import AdapterDtype, PeftBackend  # noqa: E402
from tandem_trainer.backends.resident import ResidentBudget  # noqa: E402
from tandem_trainer.errors import CheckpointError  # noqa: E402

log = logging.getLogger(__name__)


class UnslothBackend(PeftBackend):
    name = "unsloth"

    def __init__(self, device: str = "cuda", *, max_seq_length: int = 4096,
                 adapter_dtype: AdapterDtype = "float32", resident: ResidentBudget | None = None,
                 gather_copy: bool = False) -> None:
        super().__init__(device=device, gradient_checkpointing=False, adapter_dtype=adapter_dtype,
                         resident=resident, gather_copy=gather_copy)
        self.max_seq_length = max_seq_length
        self._wrapped: PeftModel | None = None
        self._wrapped_shape: tuple[int, float, float, tuple[str, ...]] | None = None

    def _load_base(self, base_model: str) -> PreTrainedModel:
        model: PreTrainedModel  # Unsloth's patched transformers model (unsloth ships no types)
        model, _tokenizer = FastLanguageModel.from_pretrained(
            model_name=base_model,
            max_seq_length=self.max_seq_length,
            dtype=self.dtype,
            load_in_4bit=False,
            full_finetuning=False,
            # a data-parallel rank's own GPU (Unsloth would pick cuda:LOCAL_RANK itself)
            **({"device_map": str(self.device)} if self.device.index is not None else {}),
        )
        model.config.use_cache = False
        self._wrapped, self._wrapped_shape = None, None
        return model

    def _wrap(self, spec: RunSpec, config: LoraConfig) -> PeftModel:
        shape = (spec.lora.r, spec.lora.alpha, spec.lora.dropout, tuple(sorted(spec.lora.target_modules)))
        if self._wrapped is not None and self._wrapped_shape == shape:
            reset_lora(self._wrapped)
            return self._wrapped
        model: PeftModel = FastLanguageModel.get_peft_model(
            self._base,
            r=spec.lora.r,
            lora_alpha=spec.lora.alpha,
            lora_dropout=spec.lora.dropout,
            target_modules=list(spec.lora.target_modules),
            bias="none",
            use_gradient_checkpointing="unsloth",
            random_state=spec.seed,
            use_rslora=False,
            modules_to_save=None,
        )
        self._wrapped, self._wrapped_shape = model, shape
        return model

    def _drop_adapter(self) -> None:
        """Keep Unsloth's LoRA layers in place (they are reused); forget the optimizer and state, and
        the gradients, which the reused parameters would otherwise carry into the next adapter."""
        self.drop_gradients("the run's adapter is replaced (another version of it, or another base model)")
        self._model, self._optimizer, self._params, self._spec, self._active = None, None, [], None, None


def reset_lora(model: PeftModel) -> None:
    """Fresh LoRA weights (A random, B zero) in place, under the caller's seed.

    Unsloth puts peft's own LoRA layers on the model; finding none means the run would train
    on another run's weights, so that is an error, not a no-op.
    """
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    if not layers:
        raise CheckpointError(f"no LoRA layers to re-initialise in {type(model).__name__}; "
                              "set TANDEM_BACKEND__KIND=peft")
    with torch.no_grad():
        for layer in layers:
            for name in list(layer.lora_A.keys()):
                layer.reset_lora_parameters(name, True)  # type: ignore[no-untyped-call]  # peft: untyped
