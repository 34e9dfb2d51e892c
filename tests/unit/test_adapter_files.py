"""The adapter's way out: host buffers reused across versions, and safetensors written from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file

from tandem.adapters import file_checksum
from tandem_trainer.adapter_files import HostBuffers, write_safetensors
from tandem_trainer.errors import CheckpointError


def lora_tensors(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(rank, 32, generator=g),
        "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, rank, generator=g),
        "base_model.model.layers.1.mlp.down_proj.lora_A.weight": torch.randn(rank, 64, generator=g),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_file_reads_back_with_safetensors_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {k: v.to(dtype) for k, v in lora_tensors(1).items()}
    path = tmp_path / "adapter_model.safetensors"
    digest = write_safetensors(path, tensors, {"format": "pt"})
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert digest == file_checksum(path)  # hashed as written equals hashed when read back


def test_odd_shapes_and_an_empty_tensor_keep_the_data_aligned(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(3, dtype=torch.bfloat16), "empty": torch.zeros(0, 5),
               "scalar": torch.tensor(2.5), "b": torch.ones(7, 3, dtype=torch.float16)}
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0
    back = load_file(path)
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in tensors.items()}
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["scalar"], tensors["scalar"])


def test_a_tensor_that_is_not_contiguous_on_the_cpu_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'t'.*contiguous"):
        write_safetensors(tmp_path / "w.safetensors", {"t": torch.ones(4, 4).t()})


def test_buffers_are_kept_across_versions_and_cast_to_the_adapter_dtype() -> None:
    host = HostBuffers(torch.device("cpu"))
    first = host.fill(lora_tensors(1), torch.bfloat16)
    kept = {k: v.data_ptr() for k, v in first.items()}
    assert all(v.dtype == torch.bfloat16 for v in first.values())
    second = host.fill(lora_tensors(2), torch.bfloat16)
    assert {k: v.data_ptr() for k, v in second.items()} == kept  # the same memory, refilled
    for name, tensor in lora_tensors(2).items():
        assert torch.equal(second[name], tensor.to(torch.bfloat16))


def test_buffers_follow_a_change_of_rank_and_drop_tensors_that_are_gone() -> None:
    host = HostBuffers(torch.device("cpu"))
    host.fill(lora_tensors(1, rank=4), torch.float32)
    wider = lora_tensors(1, rank=8)
    del wider["base_model.model.layers.1.mlp.down_proj.lora_A.weight"]
    filled = host.fill(wider, torch.float32)
    assert list(filled) == list(wider) and host._buffers.keys() == wider.keys()  # the gone one dropped
    assert all(torch.equal(filled[k], wider[k]) for k in wider)


def test_an_adapters_tensors_share_one_host_buffer_in_the_files_order() -> None:
    """With gather (backend.gather_adapter_copy), one flat buffer, each tensor a view of its slice,
    back to back as the file lays them out: one transfer from the device instead of one a tensor."""
    tensors = lora_tensors(4)
    alone = HostBuffers(torch.device("cpu")).fill(tensors, torch.bfloat16)  # without gather: a buffer each
    assert len({t.untyped_storage().data_ptr() for t in alone.values()}) == len(tensors)
    filled = HostBuffers(torch.device("cpu"), gather=True).fill(tensors, torch.bfloat16)
    ptrs = [(t.data_ptr(), t.numel() * t.element_size()) for t in filled.values()]
    assert all(start + size == nxt for (start, size), (nxt, _) in zip(ptrs, ptrs[1:], strict=False))
    assert len({t.untyped_storage().data_ptr() for t in filled.values()}) == 1
    assert all(filled[k].shape == v.shape and torch.equal(filled[k], v.to(torch.bfloat16)) for k, v in tensors.items())


def test_with_gather_tensors_of_two_dtypes_each_keep_a_buffer_of_their_own() -> None:
    tensors = {**lora_tensors(5), "steps": torch.arange(3)}  # an integer tensor is not cast
    host = HostBuffers(torch.device("cpu"), gather=True)
    filled = host.fill(tensors, torch.bfloat16)
    assert filled["steps"].dtype == torch.int64 and torch.equal(filled["steps"], torch.arange(3))
    assert all(filled[k].dtype == torch.bfloat16 for k in lora_tensors(5))
    again = host.fill(lora_tensors(6), torch.bfloat16)  # and back to one buffer
    assert all(torch.equal(again[k], v.to(torch.bfloat16)) for k, v in lora_tensors(6).items())


def test_from_one_buffer_the_file_is_written_whole_and_the_same_byte_for_byte(tmp_path: Path) -> None:
    """Staged from the flat buffer (gather), the file goes out as its header and the buffer's bytes,
    not a tensor at a time: the same file, the same checksum. The header is made once a layout
    and again when the layout changes (another rank)."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], base_model_name_or_path="base")
    host = HostBuffers(torch.device("cpu"), gather=True)
    files = {}
    for name, gather, seed, rank in [("each", False, 1, 4), ("flat", True, 1, 4), ("again", True, 2, 4),
                                     ("rank8", True, 3, 8)]:
        staged = (host if gather else HostBuffers(torch.device("cpu"))).stage(
            lora_tensors(seed, rank), torch.bfloat16, config)
        assert (staged.data is not None) is gather
        adapter = tmp_path / name
        adapter.mkdir()
        checksums = staged.write(adapter)
        weights = adapter / "adapter_model.safetensors"
        assert checksums["adapter/adapter_model.safetensors"] == file_checksum(weights)
        back = load_file(weights)
        assert all(torch.equal(back[k], v.to(torch.bfloat16)) for k, v in lora_tensors(seed, rank).items())
        files[name] = (weights.read_bytes(), staged.header)
    assert files["flat"][0] == files["each"][0]  # byte for byte the file written a tensor at a time
    assert files["again"][1] is files["flat"][1]  # the same layout: the header made once
    assert files["rank8"][1] != files["flat"][1]


def test_a_write_that_fails_names_its_directory_while_the_checksum_beside_it_is_waited_for(tmp_path: Path) -> None:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], base_model_name_or_path="base")
    staged = HostBuffers(torch.device("cpu"), gather=True).stage(lora_tensors(3), torch.bfloat16, config)
    with pytest.raises(CheckpointError, match="no-such-dir"):
        staged.write(tmp_path / "no-such-dir" / "adapter")
    assert not (tmp_path / "no-such-dir").exists()  # the config's thread beside the write made nothing
    adapter = tmp_path / "adapter"  # and the same buffers write whole afterwards
    adapter.mkdir()
    checksums = staged.write(adapter)
    assert checksums["adapter/adapter_model.safetensors"] == file_checksum(adapter / "adapter_model.safetensors")


def test_a_config_that_cannot_be_written_beside_good_weights_names_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], base_model_name_or_path="base")
    staged = HostBuffers(torch.device("cpu"), gather=True).stage(lora_tensors(3), torch.bfloat16, config)

    def full(self: LoraConfig, save_directory: str, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LoraConfig, "save_pretrained", full)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    with pytest.raises(CheckpointError, match=f"{adapter}.*No space left"):
        staged.write(adapter)
    monkeypatch.undo()
    checksums = staged.write(adapter)  # the same buffers, written whole once the disk has room
    assert checksums["adapter/adapter_config.json"] == file_checksum(adapter / "adapter_config.json")


def test_the_staged_adapter_writes_what_peft_and_the_manifest_need(tmp_path: Path) -> None:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], base_model_name_or_path="base")
    staged = HostBuffers(torch.device("cpu")).stage(lora_tensors(3), torch.bfloat16, config)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    checksums = staged.write(adapter)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert checksums == {f"adapter/{p.name}": file_checksum(p) for p in adapter.iterdir()}
    assert LoraConfig.from_pretrained(str(adapter)).r == 4
    assert staged.nbytes == sum(t.numel() * 2 for t in lora_tensors(3).values())


def test_short_writes_go_on_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`writev` may write fewer bytes than given (a signal; Linux's cap near 2 GiB a call): the
    file must still hold every byte once, whatever buffer a call stopped in."""
    import os

    real = os.writev
    calls = []

    def short(fd: int, buffers: list[memoryview]) -> int:  # at most 100 bytes a call, so most stop mid-buffer
        calls.append(len(buffers))
        data = b"".join(bytes(b) for b in buffers)[:100]
        return real(fd, [data])

    monkeypatch.setattr(os, "writev", short)
    tensors = {k: v.to(torch.bfloat16) for k, v in lora_tensors(3, rank=8).items()}
    path = tmp_path / "adapter_model.safetensors"
    digest = write_safetensors(path, tensors, {"format": "pt"})
    monkeypatch.setattr(os, "writev", real)
    back = load_file(path)
    assert all(torch.equal(back[name], tensor) for name, tensor in tensors.items())
    assert digest == file_checksum(path) and len(calls) > 20


@pytest.mark.gpu
def test_with_gather_on_cuda_the_adapter_crosses_once_into_pinned_memory() -> None:
    device = torch.device("cuda")
    tensors = {k: v.to(device) for k, v in lora_tensors(7).items()}
    host = HostBuffers(device, gather=True)
    filled = host.fill(tensors, torch.bfloat16)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in filled.values())
    assert len({t.untyped_storage().data_ptr() for t in filled.values()}) == 1
    assert all(torch.equal(filled[k], v.to(torch.bfloat16).cpu()) for k, v in tensors.items())
    again = host.fill({k: v * 2 for k, v in tensors.items()}, torch.bfloat16)  # the same buffer, refilled
    assert [t.data_ptr() for t in again.values()] == [t.data_ptr() for t in filled.values()]
    assert all(torch.equal(again[k], (v * 2).to(torch.bfloat16).cpu()) for k, v in tensors.items())
