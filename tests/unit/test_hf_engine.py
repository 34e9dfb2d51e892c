"""The transformers engine's runtime, driven directly on the tiny model (no HTTP)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem_inference.engines.transformers.model import Model
from tandem_inference.engines.transformers.runtime import HFEngine
from tandem_inference.engines.transformers.sampling import SamplingParams
from tandem_inference.errors import (
    AdapterLoadFailed,
    AdapterNotLoaded,
    EngineBusy,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
)
from tandem_trainer.tiny_model import build_random_adapter

PROMPT = "What is the sum of 12 and 30?"


def edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def teacher_forced(engine: HFEngine, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """Logprobs of `output` after `prompt` from one plain forward pass at `temperature` (what the trainer computes)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + output])
        logits = engine.model.hf(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1).tolist()


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> HFEngine:
    return HFEngine(str(tiny_model), device="cpu", max_lora_rank=16, max_loaded_adapters=3)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_adapter(tiny_model, tmp_path_factory.mktemp("adapters") / "a")


@pytest.fixture
def loaded(engine: HFEngine, adapter_dir: Path):
    """The engine with adapter `a` loaded; every adapter is unloaded again afterwards."""
    engine.load_adapter("a", adapter_dir)
    yield engine
    for name in engine.adapters:
        engine.unload_adapter(name)
    assert engine.lora.peft is None


def sample(engine: HFEngine, adapter: str | None = None, **kw) -> list[list[int]]:
    params = SamplingParams(**{"max_new_tokens": 16, "seed": 7, "ignore_eos": True, **kw})
    return [s.output_ids for s in engine.generate(engine.model.encode(PROMPT), params, adapter)]


def test_seeded_sampling_is_reproducible_and_unseeded_is_not(engine: HFEngine) -> None:
    assert sample(engine) == sample(engine)
    assert sample(engine, seed=None, n=4, max_new_tokens=24) != sample(
        engine, seed=None, n=4, max_new_tokens=24
    )


def test_greedy_equals_argmax_of_teacher_forced_pass(engine: HFEngine) -> None:
    prompt = engine.model.encode(PROMPT)
    out = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    with torch.inference_mode():
        logits = engine.model.hf(input_ids=torch.tensor([prompt + out.output_ids])).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out.output_ids
    assert out.finish_reason == "length" and out.prompt_tokens == len(prompt)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.01},
                                {"temperature": 0.3}, {"temperature": 0}])
def test_logprobs_match_teacher_forced_recomputation(loaded: HFEngine, kw: dict) -> None:
    """The trainer recomputes these: logprobs of the sampled tokens under the temperature-scaled,
    unfiltered distribution (temperature 1 for greedy), and not under the unscaled one."""
    prompt = loaded.model.encode(PROMPT)
    params = SamplingParams(max_new_tokens=20, n=3, seed=3, **kw)
    temperature = kw.get("temperature") or 1.0
    for adapter in (None, "a"):
        for seq in loaded.generate(prompt, params, adapter):
            with loaded.lora.activated(adapter):
                expected = teacher_forced(loaded, prompt, seq.output_ids, temperature)
                unscaled = teacher_forced(loaded, prompt, seq.output_ids)
            assert len(seq.logprobs) == len(seq.output_ids) > 0
            assert max(abs(a - b) for a, b in zip(seq.logprobs, expected, strict=False)) < 1e-4
            if temperature != 1.0:
                assert max(abs(a - b) for a, b in zip(seq.logprobs, unscaled, strict=False)) > 0.05


def test_adapter_changes_the_distribution_and_base_is_untouched(loaded: HFEngine) -> None:
    base = sample(loaded, temperature=0)
    assert sample(loaded, "a", temperature=0) != base
    prompt = loaded.model.encode(PROMPT)
    with loaded.lora.activated("a"):
        with_adapter = teacher_forced(loaded, prompt, base[0])
    with loaded.lora.activated(None):
        without = teacher_forced(loaded, prompt, base[0])
    assert max(abs(a - b) for a, b in zip(with_adapter, without, strict=False)) > 0.1
    assert sample(loaded, None, temperature=0) == base


def test_n_samples_are_one_batch_of_distinct_sequences(engine: HFEngine) -> None:
    seqs = engine.generate(engine.model.encode(PROMPT), SamplingParams(max_new_tokens=24, n=8, seed=1))
    assert len(seqs) == 8
    assert len({tuple(s.output_ids) for s in seqs}) > 1
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    assert all(len(s.logprobs) == len(s.output_ids) for s in seqs)


def test_stop_token_ids_and_stop_strings_end_a_sequence(engine: HFEngine) -> None:
    prompt = engine.model.encode(PROMPT)
    free = engine.generate(prompt, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))[0]
    token = free.output_ids[5]
    by_id = engine.generate(
        prompt, SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=(token,), ignore_eos=True)
    )[0]
    first = free.output_ids.index(token)
    assert by_id.output_ids == free.output_ids[: first + 1]
    assert (by_id.finish_reason, by_id.matched) == ("stop", token)

    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    by_str = engine.generate(
        prompt, SamplingParams(max_new_tokens=30, temperature=0, stop=(stop,), ignore_eos=True)
    )[0]
    assert (by_str.finish_reason, by_str.matched) == ("stop", stop)
    assert by_str.text == text[: text.index(stop)]
    assert stop not in by_str.text


def test_eos_ends_a_sequence_unless_ignored(engine: HFEngine) -> None:
    prompt = engine.model.encode(PROMPT)
    seqs = engine.generate(prompt, SamplingParams(max_new_tokens=200, n=16, seed=0))
    stopped = [s for s in seqs if s.finish_reason == "stop"]
    assert stopped, "the tiny model should emit an eos token within 200 tokens in 16 samples"
    assert all(s.matched in engine.model.eos_ids and s.output_ids[-1] == s.matched for s in stopped)
    ignored = engine.generate(prompt, SamplingParams(max_new_tokens=50, n=4, seed=0, ignore_eos=True))
    assert all(s.finish_reason == "length" and len(s.output_ids) == 50 for s in ignored)


@pytest.mark.parametrize(
    "ids, params, message",
    [
        ([], SamplingParams(), "empty input"),
        ([1, 10_000], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(max_new_tokens=5000), "exceeds the model's context length 1024"),
        ([1, 2], SamplingParams(n=0), "n=0 must be >= 1"),
        ([1, 2], SamplingParams(top_p=0), "top_p=0"),
        ([1, 2], SamplingParams(top_k=0), "top_k=0"),
        ([1, 2], SamplingParams(temperature=-1), "temperature=-1"),
    ],
)
def test_bad_requests_are_refused_with_the_value_named(engine: HFEngine, ids, params, message) -> None:
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(ids, params)


def test_unknown_adapter_is_refused_like_sglang(engine: HFEngine) -> None:
    with pytest.raises(AdapterNotLoaded, match="Got LoRA adapter that has never been loaded"):
        engine.generate(engine.model.encode(PROMPT), SamplingParams(max_new_tokens=2), "nope")
    with pytest.raises(AdapterNotLoaded, match="not loaded"):
        engine.unload_adapter("nope")


def test_failed_loads_change_nothing(
    loaded: HFEngine, adapter_dir: Path, tiny_model: Path, tmp_path: Path
) -> None:
    before_a, before_base = sample(loaded, "a"), sample(loaded)
    no_config = shutil.copytree(adapter_dir, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    no_weights = shutil.copytree(adapter_dir, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    cases = [
        ("a", adapter_dir, "Failed to load LoRA adapter a because it is already loaded"),
        ("b", tmp_path / "missing", "is not a local directory"),
        ("b", no_config, "no adapter_config.json"),
        ("b", no_weights, "no adapter_model.safetensors"),
        ("b", build_random_adapter(tiny_model, tmp_path / "r32", rank=32), "r=32 exceeds max_lora_rank=16"),
        (
            "b",
            edit_config(adapter_dir, tmp_path / "t", target_modules=["q_proj", "qkv_proj"]),
            r"target modules \['qkv_proj'\] do not exist",
        ),
        ("b", edit_config(adapter_dir, tmp_path / "dora", use_dora=True), "DoRA"),
        ("b", edit_config(adapter_dir, tmp_path / "mts", modules_to_save=["lm_head"]), "modules_to_save"),
        ("b", edit_config(adapter_dir, tmp_path / "drop", lora_dropout="x"), "peft could not load it"),
        ("x:y", adapter_dir, "contain no ':'"),
    ]
    for name, path, message in cases:
        with pytest.raises(AdapterLoadFailed, match=message):
            loaded.load_adapter(name, path)
        assert loaded.adapters == {"a": str(adapter_dir)}
        assert sample(loaded, "a") == before_a, name
        assert sample(loaded) == before_base


def test_failed_first_load_leaves_the_plain_base_model(
    engine: HFEngine, adapter_dir: Path, tmp_path: Path
) -> None:
    before = sample(engine)
    with pytest.raises(AdapterLoadFailed, match="peft could not load it"):
        engine.load_adapter("b", edit_config(adapter_dir, tmp_path / "drop", lora_dropout="x"))
    assert engine.lora.peft is None and engine.adapters == {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert not any(isinstance(m, BaseTunerLayer) for m in engine.model.hf.modules())
    assert sample(engine) == before


def test_adapter_limit_then_unload_frees_a_slot(loaded: HFEngine, tiny_model: Path, tmp_path: Path) -> None:
    for i in (1, 2):
        loaded.load_adapter(f"a{i}", build_random_adapter(tiny_model, tmp_path / str(i), seed=i))
    assert sample(loaded, "a1") != sample(loaded, "a2")
    with pytest.raises(AdapterLoadFailed, match="3 adapters are loaded already"):
        loaded.load_adapter("a3", tmp_path / "1")
    loaded.unload_adapter("a1")
    loaded.load_adapter("a3", tmp_path / "1")
    assert set(loaded.adapters) == {"a", "a2", "a3"}


def test_unloading_the_last_adapter_restores_the_base_model(engine: HFEngine, adapter_dir: Path) -> None:
    before = sample(engine)
    for _ in range(2):  # load, unload, and again: re-wrapping works
        engine.load_adapter("a", adapter_dir)
        assert sample(engine, "a") != before
        engine.unload_adapter("a")
        assert engine.lora.peft is None
        assert sample(engine) == before


def test_unload_waits_for_in_flight_requests(loaded: HFEngine) -> None:
    done = threading.Event()
    with loaded.in_flight("a"):
        worker = threading.Thread(target=lambda: (loaded.unload_adapter("a"), done.set()))
        worker.start()
        time.sleep(0.2)
        assert not done.is_set()
        with pytest.raises(AdapterNotLoaded):  # unregistered at once: new requests are refused
            loaded.generate(loaded.model.encode(PROMPT), SamplingParams(max_new_tokens=2), "a")
    worker.join(5)
    assert done.is_set() and loaded.adapters == {}


def test_unload_timeout_keeps_the_adapter(loaded: HFEngine) -> None:
    with loaded.in_flight("a"), pytest.raises(EngineBusy, match="still used by 1 request"):
        loaded.unload_adapter("a", timeout_s=0.1)
    assert "a" in loaded.adapters
    assert sample(loaded, "a")


def test_release_refuses_generation_until_resume(engine: HFEngine) -> None:
    before = sample(engine)
    engine.release(timeout_s=5)
    assert engine.released
    with pytest.raises(EngineUnavailable, match="resume_memory_occupation"):
        sample(engine)
    engine.resume()
    assert not engine.released and sample(engine) == before


def test_release_waits_for_in_flight_requests(engine: HFEngine) -> None:
    with engine.in_flight(None), pytest.raises(EngineBusy, match="still running"):
        engine.release(timeout_s=0.1)
    assert not engine.released


def test_identical_unseeded_requests_waiting_for_the_model_run_as_one_batch(loaded: HFEngine) -> None:
    """Clients fan a group out as n identical requests; waiting twins share one batched run."""
    prompt = loaded.model.encode(PROMPT)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    results: dict[int, list] = {}

    def request(i: int, n: int, adapter: str | None) -> None:
        results[i] = loaded.generate(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True, n=n), adapter)

    jobs = [(i, 1, "a") for i in range(6)] + [(6, 2, "a"), (7, 1, None)]
    with loaded.model_lock:  # the model is busy: every request queues up
        before = loaded.batches_run
        threads = [threading.Thread(target=request, args=job) for job in jobs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while loaded.coalescer.waiting() < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(10)
    assert loaded.batches_run - before == 2  # one for the 7 requests on "a", one for the base model
    assert [len(results[i]) for i in range(8)] == [1, 1, 1, 1, 1, 1, 2, 1]
    samples = [s for i in range(7) for s in results[i]]
    assert len({tuple(s.output_ids) for s in samples}) > 1  # independent samples, not copies
    for seq in samples:
        with loaded.lora.activated("a"):
            expected = teacher_forced(loaded, prompt, seq.output_ids)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected, strict=False)) < 1e-4
    assert loaded.coalescer.waiting() == 0 and params.n == 1


@pytest.mark.parametrize("model", ["/no/such/model", "./no-such-model"])
def test_a_model_directory_that_is_not_there_is_named_as_such(model: str) -> None:
    with pytest.raises(EngineError, match=r"no such directory; give a model directory .* or a hub id"):
        Model(model, device="cpu")
