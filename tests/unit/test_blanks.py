"""Blanks: each version's weights written over a file of zeros made off the path, not into a new file."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from tandem.adapters import ADAPTER_DIR, AdapterStore, Manifest, file_checksum
from tandem.tinker_jobs import OptimStepJob
from tandem_trainer.adapter_files import HostBuffers, safetensors_header, write_safetensors
from tandem_trainer.backends.base import ADAPTER_WEIGHTS
from tandem_trainer.blanks import Blanks, write_blank
from tandem_trainer.publisher import Publisher


def tensors(seed: int, width: int = 48) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.q_proj.lora_A.weight": torch.randn(4, width, generator=g),
            "layers.0.q_proj.lora_B.weight": torch.randn(width, 4, generator=g)}


def file_size(ts: dict[str, torch.Tensor]) -> int:
    return len(safetensors_header(ts)) + sum(t.numel() * t.element_size() for t in ts.values())


@pytest.mark.parametrize("extra", [0, 4096, -200], ids=["same size", "longer blank", "shorter blank"])
def test_a_file_written_over_a_blank_is_the_file_written_new(tmp_path: Path, extra: int) -> None:
    ts = tensors(1)
    blank = write_blank(tmp_path, file_size(ts) + extra)
    inode = os.fstat(blank.fd).st_ino
    assert list(tmp_path.iterdir()) == []  # a blank has no name in the store
    over = tmp_path / "over.safetensors"
    digest = write_safetensors(over, ts, blank=blank)
    assert over.stat().st_ino == inode and blank.used  # the file is the blank, written over
    assert blank.fd == -1  # and the write closed it
    new = tmp_path / "new.safetensors"
    write_safetensors(new, ts)
    assert over.read_bytes() == new.read_bytes()
    assert digest == file_checksum(over)
    back = load_file(over)
    assert all(torch.equal(back[k], v) for k, v in ts.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors", "over.safetensors"]


def test_a_blank_that_cannot_take_the_name_is_closed_and_the_file_written_new(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"x" * 100_000)  # a name that is taken: the blank cannot be linked there
    ts = tensors(2)
    blank = write_blank(tmp_path, file_size(ts))
    inode = os.fstat(blank.fd).st_ino
    digest = write_safetensors(path, ts, blank=blank)
    assert blank.fd == -1 and not blank.used and path.stat().st_ino != inode
    assert digest == file_checksum(path) and path.stat().st_size == file_size(ts)


def test_blanks_are_written_in_the_background_and_taken_once(tmp_path: Path) -> None:
    blanks = Blanks(tmp_path)
    assert blanks.take() is None  # nothing prepared yet
    blanks.prepare(10_000)
    blanks.prepare(20_000)  # one on its way already: no second
    blanks.settle()
    blank = blanks.take()
    assert blank is not None and blank.size == 10_000 and os.fstat(blank.fd).st_size == 10_000
    assert os.pread(blank.fd, 10_000, 0) == bytes(10_000)
    assert blanks.take() is None and blanks.taken == 1
    blank.close()
    blanks.close()


def test_a_filesystem_without_unnamed_files_switches_blanks_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tandem_trainer.blanks")
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    blanks = Blanks(not_a_directory)
    blanks.prepare(4096)
    blanks.settle()
    assert blanks.take() is None and not blanks.enabled
    assert "blank.off" in caplog.text
    blanks.prepare(4096)  # off: nothing more is tried
    assert blanks.take() is None
    blanks.close()


def test_switched_off_no_blank_is_made(tmp_path: Path, redis_conn, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tandem_trainer.publisher")
    publisher = Publisher(redis_conn, AdapterStore(tmp_path), blanks=False)
    publish(publisher, 1, seed=1)
    publisher.blanks.settle()
    publish(publisher, 2, seed=2)
    assert publisher.blanks.taken == 0 and "(over a blank)" not in caplog.text


def publish(publisher: Publisher, version: int, seed: int) -> Path:
    job = OptimStepJob(run="r", job_id=f"j{version}", timeout_s=60)
    manifest = Manifest(run="r", version=version, parent=version - 1, step=version, job_id=job.job_id,
                        base_model="m", lora_rank=4)
    staged = HostBuffers(torch.device("cpu")).stage(tensors(seed), torch.float32,
                                                   LoraConfig(r=4, target_modules=["q_proj"]))
    publisher.publish(job, manifest, staged, train_s=0.0, stepped_at=time.time(), stage_ms=0.0)
    return publisher.store.adapter_dir("r", version) / ADAPTER_WEIGHTS


def test_the_next_version_is_written_over_the_blank_its_publisher_made(
    tmp_path: Path, redis_conn, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tandem_trainer.publisher")
    store = AdapterStore(tmp_path)
    publisher = Publisher(redis_conn, store)
    first = publish(publisher, 1, seed=1)
    publisher.blanks.settle()  # the blank for v2, written after v1's publish
    second = publish(publisher, 2, seed=2)
    assert publisher.blanks.taken == 1
    published = [r.getMessage() for r in caplog.records if r.getMessage().startswith("publish ")]
    assert len(published) == 2 and "(over a blank)" not in published[0] and "(over a blank)" in published[1]
    back = load_file(second)
    assert all(torch.equal(back[k], v) for k, v in tensors(2).items())
    assert not torch.equal(load_file(first)["layers.0.q_proj.lora_A.weight"], back["layers.0.q_proj.lora_A.weight"])
    assert store.verify("r", 2).files[f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}"] == file_checksum(second)
    # only the versions are in the run's directory: no blank, no staging left behind
    assert sorted(p.name for p in store.run_dir("r").iterdir()) == ["v000001", "v000002"]
    publisher.blanks.close()


def test_a_blank_that_cannot_be_linked_switches_blanks_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tandem_trainer.blanks")
    blanks = Blanks(tmp_path)
    blanks.prepare(4096)
    blanks.settle()
    blank = blanks.take()
    assert blank is not None
    assert blank.claim(tmp_path / "missing" / "w.safetensors") is None  # no such directory
    blanks.give_back(blank)
    assert blank.fd == -1 and not blanks.enabled and "blank.off" in caplog.text
    blanks.prepare(4096)
    blanks.settle()
    assert blanks.take() is None
    blanks.close()


def test_a_system_without_unnamed_files_never_tries_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "O_TMPFILE")
    blanks = Blanks(tmp_path)
    blanks.prepare(4096)
    assert not blanks.enabled and blanks.take() is None


def test_a_publish_that_fails_before_its_write_leaves_the_blank_for_the_next(tmp_path: Path, redis_conn) -> None:
    store = AdapterStore(tmp_path)
    publisher = Publisher(redis_conn, store)
    publish(publisher, 1, seed=1)
    publisher.blanks.settle()
    run_dir = store.run_dir("r")
    parked = tmp_path / "parked"
    run_dir.rename(parked)
    run_dir.write_text("")  # the run's directory is a file now: no staging directory can be made in it
    with pytest.raises(OSError):
        publish(publisher, 2, seed=2)
    run_dir.unlink()
    parked.rename(run_dir)
    blank = publisher.blanks.take()  # not taken by the failed publish, so not lost with it
    assert blank is not None and blank.fd >= 0
    publisher.blanks.give_back(blank)
    publisher.blanks.close()
