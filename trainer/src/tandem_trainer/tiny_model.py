"""Build a tiny random-weight Qwen2 causal LM with a real tokenizer, offline.

Tests, CI and the CPU demo need a model that loads through the same
``AutoTokenizer`` / ``AutoModelForCausalLM`` code paths as a real checkpoint,
but there is no model hub to download one from and a real model is far too big
for a CPU runner. So we train a small byte-level BPE tokenizer on a seeded
synthetic corpus and save it next to a freshly initialised Qwen2 model, both in
Hugging Face format. Everything is derived from fixed seeds, so two builds with
the same parameters are byte-identical and cache keys stay stable.

``build_random_adapter`` gives a LoRA adapter of such a model whose weights are random
but seeded, so tests and benchmarks have adapters that change the outputs without training;
``reseed_adapter`` copies one with new random B matrices, another adapter of the same shape
in milliseconds (for those that publish hundreds of versions).

Usage: ``python -m tandem_trainer.tiny_model OUT_DIR [--seed N] [--overwrite]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from pydantic import JsonValue

from tandem_trainer.errors import TinyModelDirTaken

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["build_random_adapter", "build_tiny_model", "reseed_adapter"]

log = logging.getLogger(__name__)

STAMP_FILE = "tandem_tiny.json"
FORMAT_VERSION = 3  # bump when the build recipe changes, so old caches rebuild
CORPUS_SEED = 1234  # corpus (and so the vocab) does not depend on the model seed
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (  # Qwen2.5's, tools included, without its default system prompt
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + tool_call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{- tool_call['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_WORDS = (
    "the a an of to and in is it that for on with as was at by be this are from or have not "
    "you we they he she one two three four five six seven eight nine ten number numbers count "
    "add sum total price year day time write list answer question user assistant system model "
    "please thanks here there what which when where why how many much more less first last "
    "next value result step digit digits math problem equals plus minus times divided"
).split()


def _synthetic_corpus(n_lines: int = 4000) -> list[str]:
    """Generate English-ish text rich in numbers, so BPE learns both words and digits."""
    rng = random.Random(CORPUS_SEED)
    syllables = ["ka", "lo", "mi", "ra", "te", "su", "ne", "po", "di", "an", "er", "in", "on", "st"]

    def word() -> str:
        if rng.random() < 0.75:
            return rng.choice(_WORDS)
        return "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))

    numbers = (  # small ints, big ints, decimals, dates, arithmetic
        lambda: str(rng.randint(0, 9)),
        lambda: str(rng.randint(10, 99999)),
        lambda: f"{rng.uniform(0, 1000):.{rng.randint(1, 3)}f}",
        lambda: f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        lambda: f"{rng.randint(0, 999)} {rng.choice('+-*/=')} {rng.randint(0, 999)}",
    )

    lines = []
    for _ in range(n_lines):
        parts = [rng.choice(numbers)() if rng.random() < 0.3 else word() for _ in range(rng.randint(3, 14))]
        text = " ".join(parts)
        text = text[:1].upper() + text[1:] + rng.choice(".,!?;:")
        if rng.random() < 0.2:  # ChatML bodies, so role names become single tokens
            text = f"{rng.choice(('system', 'user', 'assistant'))}\n{text}"
        lines.append(text)
    return lines


class Params(TypedDict):
    """What a build is made from (`build_tiny_model`'s arguments but `overwrite`); its stamp records it."""

    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    initializer_range: float
    digit_logit_scale: float


def _train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with exactly Qwen2's normalizer/pre-tokenizer/decoder.

    transformers v5 rebuilds a ``qwen2`` tokenizer's pipeline from its own code
    on load, so mirroring it keeps what we train and what gets loaded identical.
    Qwen2's regex isolates every digit (``\\p{N}``), so "0".."9" are always
    single tokens, which the toy "share of digit tokens" reward relies on.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()  # the decoder takes no options (it ignores any given)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers 5.23: untyped __init__
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def _patch_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json look like a real Qwen2 one, loadable by v4 and v5.

    Declaring ``Qwen2Tokenizer`` matches what transformers v5 picks for a
    ``qwen2`` model anyway; inlining the chat template helps older readers that
    do not look at chat_template.jinja.
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("backend", None)
    cfg.update(tokenizer_class="Qwen2Tokenizer", chat_template=CHAT_TEMPLATE, unk_token=None, bos_token=None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _build_into(tmp: Path, params: Params) -> None:
    """Write tokenizer, model, generation config and (last) the stamp into ``tmp``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tokenizer(params["vocab_size"])
    tokenizer.save_pretrained(tmp)
    _patch_tokenizer_config(tmp)
    special = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert isinstance(special, list), "a list of tokens gives a list of ids"
    eot, im_end = special
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # every id the tokenizer can emit is < vocab_size
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        initializer_range=params["initializer_range"],  # 0.02 gives logits too flat for LoRA to move
        tie_word_embeddings=False,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(params["seed"])
    model = Qwen2ForCausalLM(config)
    # NOTE: transformers 5.23 wraps PreTrainedModel.to in functools.wraps, which hides from mypy
    # that it is a bound method.
    model.to(torch.float32).eval()  # type: ignore[arg-type]
    digit_ids = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    with torch.no_grad():  # digit prior: see build_tiny_model's docstring
        model.lm_head.weight[digit_ids] *= params["digit_logit_scale"]
    model.save_pretrained(tmp, safe_serialization=True)
    # Plain sampling, so generate() draws from exactly the policy RL scores. top_k is the whole
    # vocabulary rather than 0: SGLang's OpenAI routes take their defaults from this file and
    # refuse top_k=0 (seen with 0.5.12), while a full-vocabulary top_k filters nothing anywhere.
    GenerationConfig(  # type: ignore[no-untyped-call]  # transformers 5.23: untyped __init__
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot,
        do_sample=True, temperature=1.0, top_k=len(tokenizer), top_p=1.0,
    ).save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    stamp = {**params, "format_version": FORMAT_VERSION, "n_params": n_params, "final_vocab_size": len(tokenizer)}
    (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    tmp.chmod(0o755)  # mkdtemp makes 0700 dirs; a shared model cache must be readable
    for f in tmp.iterdir():
        f.chmod(0o644)


def _read_stamp(path: Path) -> dict[str, JsonValue] | None:
    """Return the stamp of a complete build at ``path``, or None if absent/incomplete."""
    try:
        stamp = json.loads((path / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if all((path / f).is_file() for f in _REQUIRED_FILES) else None


def _matches(stamp: dict[str, JsonValue] | None, params: Params) -> bool:
    return stamp is not None and stamp.get("format_version") == FORMAT_VERSION and all(
        stamp.get(k) == v for k, v in params.items()
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.2,
    digit_logit_scale: float = 2.0,
    overwrite: bool = False,
) -> Path:
    """Build (or reuse) the tiny model at ``out_dir`` and return its path.

    ``digit_logit_scale`` multiplies the lm_head rows of the tokens "0".."9".
    A purely random model samples digits at about 10/vocab (~2-4%), so most
    short samples score 0 on the toy digit reward and RL sees little signal;
    at 2.0 roughly 20-30% of sampled tokens are digits, far from 0 and 1.
    Pass 1.0 for a plain random init.

    Idempotent: a complete build with identical parameters is reused. The build
    happens in a temp dir beside ``out_dir`` and is renamed into place, so
    readers never see a half-written model, even under concurrent builds.
    The same model built by an older recipe (format version) is rebuilt in place.
    Raises TinyModelDirTaken (a FileExistsError) if ``out_dir`` holds something else and not
    ``overwrite``.
    """
    out = Path(out_dir).resolve()
    params = Params(
        seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        digit_logit_scale=digit_logit_scale,
    )
    stamp = _read_stamp(out)
    if not overwrite and _matches(stamp, params):
        log.info("reusing tiny model at %s", out)
        return out
    # the same model from an older recipe is rebuilt; anything else there is not ours to replace
    older_recipe = stamp is not None and all(stamp.get(k) == v for k, v in params.items())
    if not older_recipe and out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise TinyModelDirTaken(f"{out} exists and is not a tiny model built with {params}; pass overwrite=True")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    trash = out.parent / f".{out.name}.old-{os.getpid()}-{time.monotonic_ns()}"
    try:
        start = time.perf_counter()
        _build_into(tmp, params)
        log.info("built tiny model in %.2fs", time.perf_counter() - start)
        if out.exists():
            if not overwrite and _matches(_read_stamp(out), params):
                return out  # a concurrent build of the same thing won the race
            out.rename(trash)  # a non-empty dir cannot be replaced directly
        os.replace(tmp, out)
    except OSError:
        if not overwrite and _matches(_read_stamp(out), params):
            return out  # lost the race to a concurrent identical build
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)
    return out


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_random_adapter(
    base: str | Path,
    out: str | Path,
    *,
    rank: int = 8,
    seed: int = 0,
    scale: float = 0.5,
    target_modules: Sequence[str] = ALL_PROJECTIONS,
    dtype: str | None = None,
) -> Path:
    """Save a LoRA adapter of the model at ``base`` to ``out`` (peft's layout) and return ``out``.

    peft starts every B matrix at zero, which leaves the model's outputs as they were; here B
    is drawn from a normal distribution times ``scale``, so the adapter changes the outputs as
    a trained one does. Every weight follows from ``seed``: the same arguments give the same
    adapter. ``lora_alpha`` is ``2 * rank``. The weights are saved in peft's dtype (float32),
    or in ``dtype`` (a torch dtype's name, e.g. "bfloat16": what the trainer publishes for a
    bfloat16 model) when given.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(target_modules))
    with torch.random.fork_rng(devices=[]):  # peft draws A from the global generator
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
            if dtype is not None and "lora_" in name:
                param.data = param.data.to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    return Path(out)


def reseed_adapter(template: str | Path, out: str | Path, seed: int, *, scale: float = 0.5) -> Path:
    """Write to ``out`` a copy of the adapter at ``template`` with every lora_B drawn anew from
    ``seed`` (times ``scale``; A and the config kept) and return ``out``: another adapter of the
    same shape whose outputs differ, written without building a peft model. The same arguments
    give the same adapter."""
    import torch
    from safetensors.torch import load_file, save_file

    template, out = Path(template), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template / "adapter_config.json", out / "adapter_config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(template / "adapter_model.safetensors"))
    for name, tensor in sorted(tensors.items()):
        if "lora_B" in name:
            tensors[name] = (torch.randn(tensor.shape, generator=gen) * scale).to(tensor.dtype)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: build the tiny model and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if out_dir holds a model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path = build_tiny_model(args.out_dir, seed=args.seed, overwrite=args.overwrite)
    except FileExistsError as exc:
        parser.exit(1, f"error: {exc}\n")
    stamp = _read_stamp(path) or {}
    log.info("tiny Qwen2: %s params, vocab %s, seed %s", stamp.get("n_params"), stamp.get("final_vocab_size"), args.seed)
    print(path)


if __name__ == "__main__":
    main()
