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
  meanwhile;
- `whole`: tandem's write from the gathered copy (`backend.gather_adapter_copy`, on by default): the
  tensors back to back in one host buffer in the file's order, written as the file's header and
  that buffer's bytes, two buffers instead of one a tensor (HostBuffers.stage);
- `blank`: tandem's write over a blank (`backend.blank_adapter_file`, on by default): the same
  `writev` into an unnamed file of zeros written before the clock starts, as the trainer
  writes one between versions (trainer/src/tandem_trainer/blanks.py).

Each write makes a new file (new pages, as a new version does) in each folder of `--dirs`
(default: one under /tmp, the store's file system in the suite, and one under /dev/shm). With
`--keep 0` each file is removed right after its write, so the next one finds its pages free; with
20 the last 20 stay, as a store keeps recent versions (`retention.keep_versions`), and new pages
come from further away. Files are removed outside the timing. Every method's bytes and checksum are compared with
`writev`'s. Results: OUT/write.json and OUT/write.md.

    python bench/gpu/gpu_write.py --out OUT [--reps 20] [--threads 2,4,8] [--dirs /tmp,/dev/shm] [--keep 0,20]
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
from tandem_trainer.blanks import Blank, write_blank

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


def blank_write(path: Path, tensors: Mapping[str, torch.Tensor], blank: Blank) -> str:
    """`write_safetensors` over `blank`; raises if the blank could not be used (a new file would
    be measured instead)."""
    digest = write_safetensors(path, tensors, METADATA, blank=blank)
    if not blank.used:
        raise RuntimeError(f"the blank could not be linked at {path}; see the log")
    return digest


def _fill(target: torch.Tensor, group: list[tuple[int, torch.Tensor]]) -> None:
    """Copy each source into `target` from its offset on."""
    for start, source in group:
        target[start:start + source.numel()].copy_(source)


def timed(write: Callable[..., str], folder: Path, reps: int, keep: int,
          before: Callable[[], dict[str, Any]] | None = None) -> tuple[list[float], str]:
    """`write` into `reps` new files (after 2 warm-ups); ms and a checksum. The last `keep` files
    stay (as the store keeps recent versions), older ones are removed outside the timing.
    `before` makes the write's keyword arguments before the clock starts."""
    times, digest, kept = [], "", []
    for i in range(reps + 2):
        path = folder / f"adapter-{i}.safetensors"
        given = before() if before is not None else {}
        t0 = time.perf_counter()
        digest = write(path, **given)
        elapsed = (time.perf_counter() - t0) * 1000
        kept.append(path)
        while len(kept) > keep:
            kept.pop(0).unlink()
        if i >= 2:
            times.append(elapsed)
    for path in kept:
        path.unlink()
    return times, digest


def measure(shape: str, parent: str, counts: list[int], pool: ThreadPoolExecutor, reps: int,
            keep: int) -> list[dict[str, Any]]:
    """Every method at one shape in a new folder under `parent`: a row each."""
    tensors = lora_tensors(shape, torch.bfloat16, torch.device("cpu"))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    methods: dict[str, Callable[[Path], str]] = {"writev": partial(write_safetensors, tensors=tensors, metadata=METADATA)}
    methods |= {f"mmap-{n}": partial(mmap_write, tensors=tensors, pool=pool, threads=n) for n in counts}
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    views = dict(zip(tensors, torch.split(flat, [t.numel() for t in tensors.values()]), strict=True))
    views = {name: view.view(tensors[name].shape) for name, view in views.items()}
    methods["whole"] = partial(write_safetensors, tensors=views, metadata=METADATA,
                               header=safetensors_header(views, METADATA), data=flat.view(torch.uint8).numpy().data)
    methods["blank"] = partial(blank_write, tensors=tensors)
    rows = []
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        folder = Path(tmp)
        reference = folder / "reference.safetensors"
        expected = write_safetensors(reference, tensors, METADATA)
        size = reference.stat().st_size
        for method, write in methods.items():
            before = (lambda: {"blank": write_blank(folder, size)}) if method == "blank" else None
            check = folder / "check.safetensors"
            identical = (write(check, **(before() if before else {})) == expected
                         and check.read_bytes() == reference.read_bytes())
            check.unlink()
            times, digest = timed(write, folder, reps, keep, before)
            rows.append({"shape": shape, "dir": parent, "method": method, "bytes": nbytes, "keep": keep,
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
    p.add_argument("--keep", default="0,20", help="comma-separated counts of recent files left in place while "
                   "writing (0: each removed at once, its pages free for the next; 20: as a store keeps versions)")
    args = p.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    with ThreadPoolExecutor(max(counts)) as pool:
        rows = [row for shape in SHAPES for parent in args.dirs.split(",") for keep in map(int, args.keep.split(","))
                for row in measure(shape, parent, counts, pool, args.reps, keep)]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"cpus": os.cpu_count(), "torch": torch.__version__, "reps": args.reps}
    (args.out / "write.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = [f"| {r['shape']} | {r['bytes'] / 1e6:.1f} | {r['dir']} | {r['keep']} | {r['method']} | {r['p50']:.1f} | "
             f"{r['p95']:.1f} | "
             f"{r['identical']} |" for r in rows]
    report = "\n".join([f"# The adapter's write ({meta['cpus']} CPUs, torch {meta['torch']}), ms of {args.reps} new "
                        "files", "", "| shape | MB | folder | files kept | method | p50 | p95 | bytes and checksum identical |",
                        "|---|---|---|---|---|---|---|---|", *table])
    (args.out / "write.md").write_text(report + "\n")
    print(report)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
