"""Full-weight reloads for the transformers engine (SGLang's `/update_weights_from_disk`).

A checkpoint directory in Hugging Face format (config.json + safetensors, one file or shards
with an index) is loaded into the running base model in place: same architecture, same
tensor names and shapes, new values. Everything is checked before a single weight changes —
the config fields that fix the architecture, every tensor name and every shape — so a
mismatched checkpoint is refused with a message naming the problem and the old weights keep
serving. Values are cast to the serving dtype.

Loaded LoRA adapters stay loaded and apply on top of the new weights, as in SGLang: peft's
injected layers keep the base weight under `<module>.base_layer`, so names are compared
with that part removed, and the adapters' own `lora_*` tensors are never touched.

torch and safetensors are imported inside functions, so importing this module is cheap.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from tandem_inference.errors import WeightsLoadFailed

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig, PreTrainedModel

#: config.json fields that must equal the serving model's (where both have them).
ARCHITECTURE_FIELDS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
_ADAPTER_PARAM = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def base_parameters(model: torch.nn.Module, *, aliases: bool = False) -> dict[str, torch.nn.Parameter]:
    """The model's own parameters by checkpoint name (peft's `base_layer` removed, adapters left out).

    With `aliases`, tied parameters appear under every name (e.g. `lm_head.weight` and
    `model.embed_tokens.weight`); without, once.
    """
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=not aliases):
        if _ADAPTER_PARAM.search(name):
            continue
        out[name.replace(".base_layer.", ".")] = param
    return out


def read_checkpoint(path: str | Path, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name, after checking them against `model`; nothing changes yet.

    Raises WeightsLoadFailed naming the first problem: not a local directory, no config or
    weights, an architecture field that differs, a missing or unknown tensor, a shape that
    differs.
    """
    directory = Path(path)
    prefix = f"Failed to update weights from {str(path)!r}"
    if not directory.is_dir():
        raise WeightsLoadFailed(f"{prefix}: not a local directory (give the path of a saved Hugging Face model)")
    _check_config(directory, model.config, prefix)
    files = _weight_files(directory, prefix)
    shapes = _tensor_shapes(files, prefix)
    required = base_parameters(model)
    known = base_parameters(model, aliases=True)
    missing = sorted(set(required) - set(shapes) - _aliased(known, shapes))
    if missing:
        raise WeightsLoadFailed(
            f"{prefix}: {len(missing)} tensor(s) of the serving model are missing from the checkpoint, "
            f"e.g. {missing[:3]}"
        )
    unknown = sorted(set(shapes) - set(known))
    if unknown:
        raise WeightsLoadFailed(
            f"{prefix}: {len(unknown)} tensor(s) do not exist in the serving model, e.g. {unknown[:3]}"
        )
    for name, shape in shapes.items():
        want = tuple(known[name].shape)
        if shape != want:
            raise WeightsLoadFailed(
                f"{prefix}: tensor {name!r} has shape {shape}, the serving model's has {want}"
            )
    return _load(files, prefix)


def copy_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checked tensors into the model's parameters in place (cast to their dtype and device)."""
    import torch

    params = base_parameters(model, aliases=True)
    with torch.no_grad():
        for name, tensor in tensors.items():
            param = params[name]
            param.copy_(tensor.to(dtype=param.dtype, device=param.device))


def _aliased(known: dict[str, torch.nn.Parameter], present: dict[str, tuple[int, ...]]) -> set[str]:
    """Names whose tensor is tied to one the checkpoint holds under another name."""
    by_tensor: dict[int, set[str]] = {}
    for name, param in known.items():
        by_tensor.setdefault(id(param), set()).add(name)
    return {alias for names in by_tensor.values() if names & set(present) for alias in names}


def _check_config(directory: Path, serving: PreTrainedConfig, prefix: str) -> None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise WeightsLoadFailed(f"{prefix}: no config.json in the directory") from None
    except (OSError, ValueError) as exc:
        raise WeightsLoadFailed(f"{prefix}: config.json is unreadable: {exc}") from exc
    if not isinstance(config, dict):
        raise WeightsLoadFailed(f"{prefix}: config.json is not a JSON object; save the model with save_pretrained")
    ours = serving.to_dict()
    for field in ARCHITECTURE_FIELDS:
        if field in config and field in ours and config[field] != ours[field]:
            raise WeightsLoadFailed(
                f"{prefix}: config.json has {field}={config[field]!r}, the serving model has "
                f"{ours[field]!r}; only a checkpoint of the same architecture can be loaded in place"
            )


def _weight_files(directory: Path, prefix: str) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise WeightsLoadFailed(f"{prefix}: {index.name} is unreadable: {exc}") from exc
        files = sorted({directory / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightsLoadFailed(f"{prefix}: shard(s) {absent} named in {index.name} are missing")
        return files
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    raise WeightsLoadFailed(
        f"{prefix}: no safetensors weights (model.safetensors or model.safetensors.index.json)"
    )


def _tensor_shapes(files: list[Path], prefix: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor, read from the file headers only."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise WeightsLoadFailed(f"{prefix}: {f.name} is unreadable: {exc}") from exc
    return shapes


def _load(files: list[Path], prefix: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise WeightsLoadFailed(f"{prefix}: {f.name} is unreadable: {exc}") from exc
    return tensors
