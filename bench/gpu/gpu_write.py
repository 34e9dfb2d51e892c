"""On a GPU host: the trainer's write of an adapter file, one writer against several threads.

The sync path's "write" stage (`tandem_trainer.adapter_files.write_safetensors`) takes about
2 GB/s on an H200 host: 11 ms for a 0.5B rank-16 adapter (17.6 MB), 41 ms at 8B (83.9 MB),
fresh page-cache pages filled by one thread (docs/benchmarks.md, "Policy sync at the floor").
This measures, at both shapes, with the adapter's bfloat16 tensors in host memory as the trainer
stages them:

- `writev`: tandem's write, the bytes back to back in `os.writev` calls, hashed (xxh3-128) as
  they go;
- `mmap-N`: the file sized first, mapped, and its byte ranges filled by N threads at once
  (PyTorch's copy lets go of the GIL), hashed from the same tensors by the calling thread
  meanwhile.

Each write makes a new file (new pages, as a new version does) in each folder of `--dirs`
(default: one under /tmp, the store's file system in the suite, and one under /dev/shm); the
files are removed outside the timing. Every method's bytes and checksum are compared with
`writev`'s. Results: OUT/write.json and OUT/write.md.

    python bench/gpu/gpu_write.py --out OUT [--reps 20] [--threads 2,4,8] [--dirs /tmp,/dev/shm]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from bench.gpu.gpu_stage_copy import SHAPES, lora_tensors
from tandem.adapters import CHECKSUM, new_hasher
from tandem_trainer.adapter_files import safetensors_header, write_safetensors

METADATA = {"format": "pt"}


def mmap_write(path: Path, tensors: Mapping[str, torch.Tensor], pool: ThreadPoolExecutor, threads: int) -> str:
    """The same file as `write_safetensors`, its data filled by `threads` threads through a
    shared mapping; returns its checksum, hashed from the tensors while the threads copy."""
    head = safetensors_header(tensors, METADATA)
    sources = [t.reshape(-1).view(torch.uint8) for t in tensors.values() if t.numel()]
    size = len(head) + sum(s.numel() for s in sources)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mapped:
            mapped[:len(head)] = head
            target = torch.frombuffer(mapped, dtype=torch.uint8)
            groups: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(threads)]
            offset, share = len(head), (size - len(head)) / threads
            for source in sources:  # contiguous ranges of about equal size, one a thread
                groups[min(threads - 1, int((offset - len(head)) / share))].append((offset, source))
                offset += source.numel()

            filling = [pool.submit(_fill, target, group) for group in groups if group]
            hasher = new_hasher(CHECKSUM)
            hasher.update(head)
            for source in sources:
                hasher.update(memoryview(source.numpy().data))
            for future in filling:
                future.result()
            del target  # the mapping closes only without views into it
    finally:
        os.close(fd)
    return str(hasher.hexdigest())


def _fill(target: torch.Tensor, group: list[tuple[int, torch.Tensor]]) -> None:
    """Copy each source into `target` from its offset on."""
    for start, source in group:
        target[start:start + source.numel()].copy_(source)


def timed(write: Callable[[Path], str], folder: Path, reps: int) -> tuple[list[float], str]:
    """`write` into `reps` new files (after 2 warm-ups), each removed once timed; ms and a checksum."""
    times, digest = [], ""
    for i in range(reps + 2):
        path = folder / f"adapter-{i}.safetensors"
        t0 = time.perf_counter()
        digest = write(path)
        elapsed = (time.perf_counter() - t0) * 1000
        path.unlink()
        if i >= 2:
            times.append(elapsed)
    return times, digest


def measure(shape: str, parent: str, counts: list[int], pool: ThreadPoolExecutor, reps: int) -> list[dict[str, Any]]:
    """Every method at one shape in a new folder under `parent`: a row each."""
    tensors = lora_tensors(shape, torch.bfloat16, torch.device("cpu"))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    methods: dict[str, Callable[[Path], str]] = {"writev": partial(write_safetensors, tensors=tensors, metadata=METADATA)}
    methods |= {f"mmap-{n}": partial(mmap_write, tensors=tensors, pool=pool, threads=n) for n in counts}
    rows = []
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        folder = Path(tmp)
        reference = folder / "reference.safetensors"
        expected = write_safetensors(reference, tensors, METADATA)
        for method, write in methods.items():
            check = folder / "check.safetensors"
            identical = write(check) == expected and check.read_bytes() == reference.read_bytes()
            check.unlink()
            times, digest = timed(write, folder, reps)
            rows.append({"shape": shape, "dir": parent, "method": method, "bytes": nbytes,
                         "identical": identical and digest == expected, "ms": times, "p50": statistics.median(times),
                         "p95": sorted(times)[int(0.95 * (len(times) - 1))]})
            print(f"{shape} {parent} {method}: {rows[-1]['p50']:.1f} ms p50 ({nbytes / 1e6:.1f} MB, "
                  f"identical={rows[-1]['identical']})", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", default="2,4,8", help="comma-separated thread counts of the mapped write")
    p.add_argument("--dirs", default=f"{tempfile.gettempdir()},/dev/shm", help="comma-separated folders to write in")
    args = p.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    with ThreadPoolExecutor(max(counts)) as pool:
        rows = [row for shape in SHAPES for parent in args.dirs.split(",")
                for row in measure(shape, parent, counts, pool, args.reps)]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"cpus": os.cpu_count(), "torch": torch.__version__, "reps": args.reps}
    (args.out / "write.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = [f"| {r['shape']} | {r['bytes'] / 1e6:.1f} | {r['dir']} | {r['method']} | {r['p50']:.1f} | {r['p95']:.1f} | "
             f"{r['identical']} |" for r in rows]
    report = "\n".join([f"# The adapter's write ({meta['cpus']} CPUs, torch {meta['torch']}), ms of {args.reps} new "
                        "files", "", "| shape | MB | folder | method | p50 | p95 | bytes and checksum identical |",
                        "|---|---|---|---|---|---|---|", *table])
    (args.out / "write.md").write_text(report + "\n")
    print(report)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
