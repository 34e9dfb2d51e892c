"""The Unsloth backend: the peft backend's job logic on Unsloth's fast LoRA kernels (CUDA).

Unsloth patches transformers when it is imported, so this module is imported only when
the backend is chosen, before anything else touches transformers. It loads the base model
with `FastLanguageModel.from_pretrained` and puts LoRA on it with
`FastLanguageModel.get_peft_model` once per LoRA shape; a later run with the same shape
reuses those layers (re-initialised for a fresh run, or overwritten with a version's
weights), because Unsloth expects to wrap a model once.

Adapters are saved the way the peft backend saves them: plain PEFT files, rslora off, no
modules_to_save, no tokenizer files, so SGLang loads them as they are.
"""

from __future__ import annotations

import logging
import os
from typing import Any

# Unsloth skips materialising logits in training forwards unless told to; GRPO needs them.
os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")

import torch  # noqa: E402
import unsloth  # noqa: E402,F401  (must come before transformers)
from peft import LoraConfig  # noqa: E402
from unsloth import FastLanguageModel  # noqa: E402

from tandem.runs import RunSpec  # noqa: E402
from tandem_trainer.peft_backend import PeftBackend  # noqa: E402

log = logging.getLogger(__name__)


class UnslothBackend(PeftBackend):
    name = "unsloth"

    def __init__(self, device: str = "cuda", *, max_seq_length: int = 4096, adapter_dtype: str = "float32") -> None:
        super().__init__(device=device, gradient_checkpointing=False, adapter_dtype=adapter_dtype)
        self.max_seq_length = max_seq_length
        self._wrapped: Any = None
        self._wrapped_shape: tuple[object, ...] | None = None

    def _load_base(self, base_model: str) -> Any:
        model, _tokenizer = FastLanguageModel.from_pretrained(
            model_name=base_model,
            max_seq_length=self.max_seq_length,
            dtype=self.dtype,
            load_in_4bit=False,
            full_finetuning=False,
        )
        model.config.use_cache = False
        self._wrapped, self._wrapped_shape = None, None
        return model

    def _wrap(self, spec: RunSpec, config: LoraConfig) -> Any:
        shape = (spec.lora.r, spec.lora.alpha, spec.lora.dropout, tuple(sorted(spec.lora.target_modules)))
        if self._wrapped is not None and self._wrapped_shape == shape:
            reset_lora(self._wrapped)
            return self._wrapped
        model = FastLanguageModel.get_peft_model(
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
        """Keep Unsloth's LoRA layers in place (they are reused); forget the optimizer and state."""
        self._model, self._optimizer, self._params, self._spec, self._active = None, None, [], None, None


def reset_lora(model: Any) -> None:
    """Fresh LoRA weights (A random, B zero) in place, under the caller's seed."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A"):
                for name in list(module.lora_A.keys()):
                    module.reset_lora_parameters(name, True)
