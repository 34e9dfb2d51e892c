"""The base model the engine serves: its loading, its tokenizer, and moving it off the GPU and back.

`Model` holds no lock: the runtime (`runtime.HFEngine`) serializes every call that runs or
moves the model. torch and transformers are imported inside functions, so importing this
module is cheap.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from tandem.runs import missing_model_directory
from tandem_inference.engines.transformers.sampling import SamplingParams
from tandem_inference.errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class Model:
    """A causal LM and its tokenizer, loaded on one device."""

    def __init__(self, path: str, *, device: str = "auto") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise EngineError("engine.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.path = str(path)
        start = time.perf_counter()
        log.info("model_load_start path=%s device=%s", self.path, self.device)
        try:
            self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self.path)
            self.hf: PreTrainedModel = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        except (OSError, ValueError) as exc:
            if missing_model_directory(self.path):
                raise EngineError(
                    f"cannot load base model {self.path!r}: no such directory; give a model directory "
                    "(config.json, tokenizer and weights) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
                ) from exc
            raise EngineError(f"cannot load base model {self.path!r}: {exc}") from exc
        # peft injects its layers into this very object: calling it runs the active adapter
        _move(self.hf, self.device).eval()
        self.vocab_size = _vocab_size(self.hf)
        # configs carry model-specific attributes (some through aliases): read them by name
        self.max_context = int(
            getattr(self.hf.config, "max_position_embeddings", 0) or self.tokenizer.model_max_length
        )
        self.eos_ids = _eos_ids(self.tokenizer, self.hf)
        self.linears = {
            n: (m.in_features, m.out_features)
            for n, m in self.hf.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        """Every linear module, name -> (in_features, out_features): what an adapter may target."""
        log.info(
            "model_load_end path=%s device=%s dtype=%s duration_ms=%.0f",
            self.path,
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
        if not isinstance(text, str):
            raise InvalidRequest(f"the chat template rendered {type(text).__name__}, not text")
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

    # -- memory -------------------------------------------------------------------------------

    def offload(self) -> None:
        """Move the weights to the CPU and free the GPU memory they and torch's caches held."""
        import torch

        if self.device.type != "cuda":
            return
        _move(self.hf, torch.device("cpu"))
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # ~32 MB per stream on Hopper
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()

    def restore(self) -> None:
        """Move the weights back to the serving device (after `offload`)."""
        if self.device.type == "cuda":
            _move(self.hf, self.device)

    def weights_device(self) -> str:
        """Where the weights are now: the serving device, or the CPU while offloaded."""
        return str(next(self.hf.parameters()).device)


def _move(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move a module's weights in place; returns it. Called through torch's own `Module` methods,
    whose signatures transformers' wrappers of `to` and `eval` do not carry."""
    return module.to(device)


def _vocab_size(model: PreTrainedModel) -> int:
    import torch

    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, torch.nn.Embedding):
        raise EngineError(
            f"the model's input embeddings are a {type(embeddings).__name__}, not an embedding table; "
            "serve a causal LM of transformers"
        )
    return int(embeddings.num_embeddings)


def _eos_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> set[int]:
    """Every id that ends a reply: the tokenizer's eos plus those of the model's configs."""
    ids: set[int] = set()
    generation = model.generation_config
    for value in (
        tokenizer.eos_token_id,
        generation.eos_token_id if generation is not None else None,
        getattr(model.config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
