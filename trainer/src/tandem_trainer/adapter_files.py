"""The adapter on its way out: device tensors -> reusable host buffers -> the version's files.

Publishing is on the path to serving, so the bytes are touched as few times as the format
allows. `HostBuffers.fill` casts the LoRA tensors to the adapter's dtype on the device
(concatenated first with `backend.gather_adapter_copy`, so that they cross in one transfer) and
copies them into host buffers kept from the previous version (pinned on CUDA); the trainer can
give the GPU back right after.
`StagedAdapter.write` then writes `adapter_model.safetensors` straight from those buffers and
hashes the same bytes as they go out: no serialised copy of the adapter is ever built, and
nothing reads the file back to checksum it. Given a blank (blanks.py: a file of zeros written
after the last version, off the path), it writes over the blank's pages instead of into a new
file's.

The safetensors layout (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensors' bytes back to back) is written here
because the library's writer serialises every tensor to a new `bytes` first; files are read
back with the library everywhere (engines, peft, the tests).
"""

from __future__ import annotations

import copy
import json
import os
import struct
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from tandem.adapters import ADAPTER_DIR, CHECKSUM, file_checksum, new_hasher
from tandem_trainer.backends.base import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tandem_trainer.blanks import Blank
from tandem_trainer.errors import CheckpointError

#: safetensors' names of the dtypes an adapter may hold.
SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}


class HostBuffers:
    """Host tensors that hold the adapter between the device and the file, kept across versions.

    With `gather` (`backend.gather_adapter_copy`), tensors that are cast (float32 LoRA matrices
    published in bfloat16), all on one device, share one flat host buffer, each a view of its
    slice in the file's order: on CUDA they are concatenated and cast on the device and cross the
    bus in one transfer, instead of one cast and one transfer a tensor. With plain tensors on an
    H200 that took the copy from 8.3 to 5.2 ms p50 at 0.5B (336 tensors) and from 10.6 to 7.8 at
    8B (448); tensors already in the adapter's dtype copied faster one by one (3.1 against 4.8 ms
    at 0.5B), so they keep a buffer each; in the Unsloth trainer the suite measured the copy at
    4.5 ms against 5.4 at 0.5B (docs/benchmarks.md). Otherwise every tensor has a
    buffer of its own. A buffer is made again only when the tensors' names, shapes or dtype
    change (another run or rank). On CUDA the buffers are pinned.
    """

    def __init__(self, device: torch.device, *, gather: bool = False) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.gather = gather
        """Whether tensors that are cast share one buffer (`backend.gather_adapter_copy`)."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._flat: torch.Tensor | None = None
        self._layout: tuple[Any, ...] = ()
        self._header: tuple[tuple[Any, ...], bytes] | None = None
        """The flat buffer's safetensors header, made once a layout (and metadata): its key, its bytes."""

    def fill(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Copy `tensors` (floating ones cast to `dtype` on their device) into the buffers and
        wait for the copies; returns the filled buffers, by name, in `tensors`' order."""
        sources = {name: tensor.detach() for name, tensor in tensors.items()}
        dtypes = {dtype if s.is_floating_point() else s.dtype for s in sources.values()}
        cast = any(s.is_floating_point() and s.dtype != dtype for s in sources.values())
        if self.gather and cast and len(dtypes) == 1 and len({s.device for s in sources.values()}) == 1:
            return self._fill_flat(sources, dtypes.pop())
        return self._fill_each(sources, dtype)

    def _fill_flat(self, sources: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        self._buffers.clear()
        layout = (dtype, *((name, tuple(s.shape)) for name, s in sources.items()))
        sizes = [s.numel() for s in sources.values()]
        if self._flat is None or layout != self._layout:
            self._flat = torch.empty(sum(sizes), dtype=dtype, pin_memory=self.pinned)
            self._layout = layout
        flat = self._flat
        slices = list(torch.split(flat, sizes))
        flat_sources = [s.reshape(-1) for s in sources.values()]
        device = next(iter(sources.values())).device
        if device.type == "cpu":
            for piece, source in zip(slices, flat_sources, strict=True):
                piece.copy_(source)  # PyTorch's fused copy is slower than this on a CPU
        else:
            flat.copy_(_gathered(flat_sources, dtype), non_blocking=self.pinned)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return {name: piece.view(source.shape) for (name, source), piece in zip(sources.items(), slices, strict=True)}

    def _fill_each(self, sources: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        self._flat, self._layout = None, ()
        filled: dict[str, torch.Tensor] = {}
        for name, source in sources.items():
            if source.is_floating_point() and source.dtype != dtype:
                source = source.to(dtype)  # on the device: half the bytes cross the bus
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=self.pinned)
                self._buffers[name] = buffer
            buffer.copy_(source, non_blocking=self.pinned)
            filled[name] = buffer
        for name in self._buffers.keys() - filled.keys():
            del self._buffers[name]
        if self.pinned:
            torch.cuda.synchronize(self.device)
        return filled

    def stage(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, config: LoraConfig) -> StagedAdapter:
        """`fill`, as a StagedAdapter that remembers how long the copies took. From the flat
        buffer it also carries the file's header (made once a layout) and the buffer's bytes,
        which are the file's data as they stand: its write takes two buffers, not one a tensor."""
        t0 = time.perf_counter()
        filled = self.fill(tensors, dtype)
        staged = StagedAdapter(filled, config, copy_ms=(time.perf_counter() - t0) * 1000)
        if self._flat is not None:
            key = (self._layout, tuple(sorted(staged.metadata.items())))
            if self._header is None or self._header[0] != key:
                self._header = (key, safetensors_header(filled, staged.metadata))
            staged.header, staged.data = self._header[1], self._flat.view(torch.uint8).numpy().data
        return staged

    def clear(self) -> None:
        self._buffers.clear()
        self._flat, self._layout, self._header = None, (), None


def _gathered(sources: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """`sources` (flat, on one device) back to back in one new tensor of `dtype` on that device:
    one concatenation (a few kernels for hundreds of tensors) and one cast of the whole, where
    they share a dtype; each cast first otherwise."""
    if len({s.dtype for s in sources}) == 1:
        return torch.cat(sources).to(dtype)
    return torch.cat([s.to(dtype) for s in sources])


@dataclass
class StagedAdapter:
    """One version's adapter in host memory, ready to be written into a version directory."""

    tensors: dict[str, torch.Tensor]
    """Host tensors in the adapter's dtype (the backend's reused buffers: write before the next stage)."""
    config: LoraConfig
    """What goes into adapter_config.json."""
    copy_ms: float
    """Device -> host, synchronised: the time the stage took."""
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})
    write_ms: dict[str, float] = field(default_factory=dict)
    """The last `write`'s parts: `hash` (the weights' checksum), `weights` (their file opened or
    linked, written, closed), `config` (adapter_config.json written and hashed); the checksum and
    the config each in a thread beside the weights."""
    header: bytes | None = None
    """The file's safetensors header, where `data` is given (HostBuffers.stage)."""
    data: memoryview | None = None
    """All the tensors' bytes back to back in the file's order (the flat buffer), or None."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, adapter_dir: Path, *, blank: Blank | None = None) -> dict[str, str]:
        """Write adapter_model.safetensors (over `blank`, when given) and adapter_config.json into
        `adapter_dir`; returns their checksums (`CHECKSUM`) by path relative to the version
        directory. Raises CheckpointError naming the directory when it cannot be written."""
        self.write_ms = {}
        # adapter_config.json is written in a thread beside the weights: making a file can wait on
        # the filesystem's journal (the last version's fsync, a blank), which the weights need not
        config = _beside_the_write().submit(self._write_config, adapter_dir)
        try:
            try:
                digest = write_safetensors(adapter_dir / ADAPTER_WEIGHTS, self.tensors, self.metadata, blank=blank,
                                           clock=self.write_ms, header=self.header, data=self.data)
            finally:
                wait([config])  # never left writing into a directory the caller may remove
            config_digest, self.write_ms["config"] = config.result()
        except OSError as exc:
            raise CheckpointError(f"cannot write the adapter to {adapter_dir}: {exc}") from exc
        return {f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}": digest, f"{ADAPTER_DIR}/{ADAPTER_CONFIG}": config_digest}

    def _write_config(self, adapter_dir: Path) -> tuple[str, float]:
        """adapter_config.json written (by peft) and hashed, and the ms it took."""
        t0 = time.perf_counter()
        if not adapter_dir.is_dir():  # peft would make it: the weights' write is to find it missing
            raise CheckpointError(f"cannot write the adapter to {adapter_dir}: the directory is missing")
        copy.deepcopy(self.config).save_pretrained(str(adapter_dir))
        digest = file_checksum(adapter_dir / ADAPTER_CONFIG, CHECKSUM)
        return digest, (time.perf_counter() - t0) * 1000


def safetensors_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `tensors` in their order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold here")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None, *, blank: Blank | None = None,
                      clock: dict[str, float] | None = None, header: bytes | None = None,
                      data: memoryview | None = None) -> str:
    """Write `tensors` (contiguous, on the CPU) as a safetensors file; returns the file's
    checksum (`CHECKSUM`), computed from the bytes as they are written. With `blank` the file
    is the blank, linked at `path` and written over (cut to size when the blank was longer); a
    blank that cannot be linked there is closed and a new file written. `clock`, when given,
    gets the ms of `hash` (taken in a thread beside the write) and of `weights` (the file opened
    or linked, written, closed).
    `header` and `data`, when given, are the file's header (`safetensors_header` of `tensors`)
    and all of `tensors`' bytes back to back in its order, written as they are (a 0.5B adapter's
    336 tensors cost milliseconds to look at one by one). Raises OSError."""
    if header is not None and data is not None:
        size = len(header) + len(data)
        views = [memoryview(header), data]
    else:
        for name, tensor in tensors.items():
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise CheckpointError(f"tensor {name!r} must be contiguous on the CPU to be written (it is on "
                                      f"{tensor.device}, contiguous={tensor.is_contiguous()})")
        views = [memoryview(safetensors_header(tensors, metadata))]
        views += [memoryview(t.reshape(-1).view(torch.uint8).numpy().data) for t in tensors.values() if t.numel()]
        size = sum(len(v) for v in views)
    # the checksum is taken in a thread while this one writes the same bytes: xxhash lets go of
    # the interpreter's lock for buffers over 64 KiB, as the write does, so the two overlap
    hashing = _beside_the_write().submit(_timed_hash, list(views))  # its own list: the write shortens its views
    t1 = time.perf_counter()
    try:
        fd = blank.claim(path) if blank is not None else None
        longer = fd is not None and blank is not None and blank.size > size
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, views)
            if longer:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        t2 = time.perf_counter()
    except BaseException:
        wait([hashing])  # never left reading buffers the caller may refill; the write's error stands
        raise
    digest, hash_ms = hashing.result()
    if clock is not None:
        clock["hash"], clock["weights"] = hash_ms, (t2 - t1) * 1000
    return digest


_BESIDE_THE_WRITE: ThreadPoolExecutor | None = None


def _beside_the_write() -> ThreadPoolExecutor:
    """The threads that take the weights' checksum and write adapter_config.json beside the
    weights' write (made on first use)."""
    global _BESIDE_THE_WRITE
    if _BESIDE_THE_WRITE is None:
        _BESIDE_THE_WRITE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="adapter-write")
    return _BESIDE_THE_WRITE


def _timed_hash(views: list[memoryview]) -> tuple[str, float]:
    """The checksum (`CHECKSUM`) of `views` back to back, and the ms it took."""
    t0 = time.perf_counter()
    hasher = new_hasher(CHECKSUM)
    for view in views:
        hasher.update(view)
    return str(hasher.hexdigest()), (time.perf_counter() - t0) * 1000


#: The most buffers one `writev` takes (the system's IOV_MAX; 1024 on Linux).
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write `views` back to back with as few system calls as the system allows (a 0.5B adapter's
    336 tensors in one, instead of one each); a call may write fewer bytes than given (a
    signal, Linux's cap near 2 GiB), so each goes on from where the last one stopped."""
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i:i + IOV_MAX])
        if written <= 0:
            raise CheckpointError(f"writev wrote nothing with {sum(len(v) for v in views[i:])} bytes left")
        while i < len(views) and written >= len(views[i]):
            written -= len(views[i])
            i += 1
        if written:
            views[i] = views[i][written:]
