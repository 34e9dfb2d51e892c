"""On a GPU: the trainer's copy of an adapter from the device into host memory, two ways.

The sync path's "copy" stage (`tandem_trainer.adapter_files.HostBuffers`) at the 0.5B and 8B
shapes (LoRA rank 16 on all seven projections), with the LoRA matrices on the GPU in float32
(cast to bfloat16 on the device) and in bfloat16:

- `each`: one cast and one device -> host copy a tensor, into a pinned buffer a tensor (336
  tensors at 0.5B, 448 at 8B), then one synchronise;
- `gathered`: concatenated and cast on the device, then one transfer into one pinned host buffer.

With `backend.gather_adapter_copy` `HostBuffers.fill` gathers where it casts (float32 matrices,
bfloat16 files) and copies one a tensor otherwise, as these two measured (docs/benchmarks.md).

Each timed fill ends with `torch.cuda.synchronize`; the host buffers are warm (kept across
versions, as in the trainer). Both ways' bytes are compared. Results: OUT/stage-copy.json and
OUT/stage-copy.md.

    python bench/gpu/gpu_stage_copy.py --out OUT [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench` when run as a script

from tandem_trainer.adapter_files import HostBuffers

#: hidden, layers, KV width, MLP width (bench.benchlib.SHAPES, without importing the bench's stack)
SHAPES = {"0.5b": (896, 24, 2 * 64, 4864), "8b": (4096, 32, 8 * 128, 14336)}
RANK = 16


def lora_tensors(shape: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    hidden, layers, kv, mlp = SHAPES[shape]
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}
    out = {}
    g = torch.Generator(device=device).manual_seed(0)
    for layer in range(layers):
        for module, (fan_in, fan_out) in dims.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g, device=device, dtype=dtype)
            out[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g, device=device, dtype=dtype)
    return out


def timed(fill: Any, reps: int) -> list[float]:
    for _ in range(3):
        fill()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fill()  # ends with its own synchronise
        times.append((time.perf_counter() - t0) * 1000)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    device = torch.device("cuda")
    rows = []
    for shape in SHAPES:
        for source_dtype in (torch.float32, torch.bfloat16):
            tensors = lora_tensors(shape, source_dtype, device)
            each, gathered = HostBuffers(device), HostBuffers(device)
            a = each._fill_each({k: v.detach() for k, v in tensors.items()}, torch.bfloat16)
            b = gathered._fill_flat({k: v.detach() for k, v in tensors.items()}, torch.bfloat16)
            same = all(torch.equal(a[k], b[k]) for k in tensors)
            row: dict[str, Any] = {
                   "shape": shape, "source_dtype": str(source_dtype).removeprefix("torch."), "tensors": len(tensors),
                   "bytes": sum(t.numel() * 2 for t in tensors.values()), "identical": same,
                   "each_ms": timed(partial(each._fill_each, dict(tensors), torch.bfloat16), args.reps),
                   "gathered_ms": timed(partial(gathered._fill_flat, dict(tensors), torch.bfloat16), args.reps)}
            row["each_p50"] = statistics.median(row["each_ms"])
            row["gathered_p50"] = statistics.median(row["gathered_ms"])
            rows.append(row)
            print(f"{shape} {row['source_dtype']}: each {row['each_p50']:.2f} ms, gathered {row['gathered_p50']:.2f} ms "
                  f"({row['tensors']} tensors, {row['bytes'] / 1e6:.1f} MB, identical={same})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps}
    (args.out / "stage-copy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# The adapter's copy to host memory ({meta['device']}, torch {meta['torch']}), p50 ms of {args.reps}", "",
             "| shape | LoRA dtype on the GPU | tensors | MB (bfloat16) | one a tensor | gathered | bytes identical |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['source_dtype']} | {r['tensors']} | {r['bytes'] / 1e6:.1f} | {r['each_p50']:.2f} | "
              f"{r['gathered_p50']:.2f} | {r['identical']} |" for r in rows]
    (args.out / "stage-copy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
