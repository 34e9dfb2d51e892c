"""The tiny offline model is the fixture every CPU test and demo stands on.

These tests pin what the rest of the suite assumes: it loads through the Auto*
classes, speaks ChatML, has single-token digits for the digit reward, and is
byte-for-byte reproducible so cached builds can be trusted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tandem.dev.cli import ensure_tiny_model
from tandem_trainer.tiny_model import build_random_adapter, build_tiny_model


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_loads_with_auto_classes_and_generates(tiny_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen2"
    assert model.dtype == torch.float32
    assert len(tokenizer) <= model.config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id

    ids = tokenizer("Count 1 2 3 to 4567, then stop.", return_tensors="pt").input_ids
    assert int(ids.max()) < model.config.vocab_size
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=5, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_chat_template_renders_chatml(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write numbers"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWrite numbers<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<|im_start|>user\nWrite numbers<|im_end|>\n"
    ids = tokenizer(text).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_digits_are_single_tokens(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    digit_ids = set()
    for d in "0123456789":
        ids = tokenizer.encode(d, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.decode(ids) == d
        digit_ids.add(ids[0])
    assert len(digit_ids) == 10
    # Numbers split into one token per digit, so a digit reward counts digits, not numbers.
    tokens = tokenizer.tokenize("In 2024 it cost 12345.")
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("202412345")


def test_same_seed_is_byte_identical_and_reused(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha256(again / name) == _sha256(tiny_dir / name), name

    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(again, seed=0) == again  # idempotent: no rebuild
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError):
        build_tiny_model(again, seed=1)
    build_tiny_model(again, seed=1, overwrite=True)
    assert _sha256(again / "model.safetensors") != _sha256(tiny_dir / "model.safetensors")
    assert _sha256(again / "tokenizer.json") == _sha256(tiny_dir / "tokenizer.json")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_a_build_from_an_older_recipe_is_rebuilt(tiny_dir: Path, tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "old", seed=0)
    stamp_path = out / "tandem_tiny.json"
    stamp = json.loads(stamp_path.read_text())
    stamp_path.write_text(json.dumps({**stamp, "format_version": 0}))
    assert build_tiny_model(out, seed=0) == out
    assert json.loads(stamp_path.read_text())["format_version"] == stamp["format_version"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["top_k"] == json.loads((out / "config.json").read_text())["vocab_size"]  # SGLang refuses 0


def test_the_demos_rebuild_a_tiny_model_from_an_older_recipe(tmp_path: Path) -> None:
    """`make demo`, `make agent` and `tandem up` reuse a cached tiny model only when its recipe is
    current (a template that renders tools came with a newer one)."""
    out = build_tiny_model(tmp_path / "cached", seed=0)
    stamp_path = out / "tandem_tiny.json"
    stamp = json.loads(stamp_path.read_text())
    stamp_path.write_text(json.dumps({**stamp, "format_version": 0}))
    ensure_tiny_model(str(out))
    assert json.loads(stamp_path.read_text())["format_version"] == stamp["format_version"]
    ensure_tiny_model(str(out))  # current: reused as it is
    assert json.loads(stamp_path.read_text()) == stamp


def test_a_random_adapter_follows_its_seed_and_changes_the_outputs(tiny_dir: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    a1 = build_random_adapter(tiny_dir, tmp_path / "a1", rank=4, seed=1, target_modules=["q_proj", "v_proj"])
    again = build_random_adapter(tiny_dir, tmp_path / "again", rank=4, seed=1, target_modules=["q_proj", "v_proj"])
    other = build_random_adapter(tiny_dir, tmp_path / "other", rank=4, seed=2, target_modules=["q_proj", "v_proj"])
    weights = {p.name: load_file(p / "adapter_model.safetensors") for p in (a1, again, other)}
    assert weights["a1"].keys() == weights["other"].keys() and weights["a1"]
    assert all(torch.equal(weights["a1"][k], weights["again"][k]) for k in weights["a1"])
    assert not all(torch.equal(weights["a1"][k], weights["other"][k]) for k in weights["a1"])
    config = json.loads((a1 / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]

    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, a1).eval()(input_ids=ids).logits
    assert not torch.allclose(plain, adapted, atol=1e-4)


def test_a_random_adapter_saved_in_bfloat16_is_the_float32_one_rounded(tiny_dir: Path, tmp_path: Path) -> None:
    """What the trainer publishes for a bfloat16 model: the same weights, in bfloat16."""
    import torch
    from safetensors.torch import load_file

    wide = build_random_adapter(tiny_dir, tmp_path / "wide", rank=4, seed=1, target_modules=["q_proj"])
    narrow = build_random_adapter(tiny_dir, tmp_path / "narrow", rank=4, seed=1, target_modules=["q_proj"],
                                  dtype="bfloat16")
    w, n = load_file(wide / "adapter_model.safetensors"), load_file(narrow / "adapter_model.safetensors")
    assert w.keys() == n.keys() and w
    assert {t.dtype for t in w.values()} == {torch.float32}
    assert {t.dtype for t in n.values()} == {torch.bfloat16}
    assert all(torch.equal(w[k].to(torch.bfloat16), n[k]) for k in w)
