"""The adapters the hot-load scenario loads, and the merge of one into the base weights.

Both need torch, transformers and peft, which tandem's own environment may lack on a GPU
machine, so they run in a subprocess (`hotload.py merge` / `hotload.py adapters`) of the first
interpreter that has them: `ctx.trainer_python` when the context has one, then
`ctx.tandem_python`, this one, `ctx.sglang_python`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HOTLOAD = Path(__file__).resolve().with_name("hotload.py")  # its `merge` and `adapters` commands
RANDOM_ADAPTER_RANK = 16
MERGE_MODULES = ("torch", "transformers", "peft")


def adapters(ctx: Any, wanted: int) -> list[Path]:
    """The newest `wanted` published versions of the run; random adapters when there are none."""
    from tandem.adapters import AdapterStore

    store = AdapterStore(ctx.store_root)
    versions = store.versions(ctx.run_name)[-wanted:]
    if versions:
        return [store.adapter_dir(ctx.run_name, v) for v in versions]
    target = Path(ctx.out) / "hotload-adapters"
    python, why = interpreter(ctx, "making adapters", (*MERGE_MODULES, "tandem_trainer"))
    if python is None:
        raise RuntimeError(f"no published versions of run {ctx.run_name!r} under {ctx.store_root}, and {why}")
    ctx.progress(f"hotload: no published versions of run {ctx.run_name!r} under {ctx.store_root}; "
                 f"making {min(wanted, 2)} random LoRA adapters (r={RANDOM_ADAPTER_RANK}) in {target}")
    proc = subprocess.run(
        [python, str(HOTLOAD), "adapters", "--base", str(ctx.model), "--out", str(target), "--count", str(min(wanted, 2))],
        capture_output=True, text=True, timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"making adapters with {python} failed: {proc.stderr.strip()[-800:]}")
    return sorted(p for p in target.iterdir() if (p / "adapter_config.json").is_file())


def interpreter(ctx: Any, purpose: str, modules: tuple[str, ...] = MERGE_MODULES) -> tuple[str | None, str]:
    """The first interpreter that imports `modules`, or None and why not.

    Tried in order: ctx.trainer_python (when the context has one), ctx.tandem_python, this
    interpreter, ctx.sglang_python. On a GPU machine tandem's own environment may hold no torch.
    """
    tried = []
    for python in dict.fromkeys(filter(None, [getattr(ctx, "trainer_python", None), ctx.tandem_python,
                                              sys.executable, ctx.sglang_python])):
        try:
            proc = subprocess.run([python, "-c", f"import {', '.join(modules)}"], capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{python}: {exc}")
            continue
        if proc.returncode == 0:
            return python, ""
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        tried.append(f"{python}: {last}")
    return None, (f"{purpose} needs an interpreter with {', '.join(modules)} (give the trainer's as "
                  f"ctx.trainer_python); tried {'; '.join(tried)}")


def run_merge(python: str, base: str, adapter: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """`hotload.py merge` in `python`; its last line of output is `merge`'s timings as JSON."""
    return subprocess.run(
        [python, str(HOTLOAD), "merge", "--base", base, "--adapter", str(adapter), "--out", str(out)],
        capture_output=True, text=True, timeout=3600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def merge(base: str, adapter: str, out: str) -> dict[str, float]:
    """Merge `adapter` into `base` and save the full model (config, weights, tokenizer) to `out`."""
    t0 = time.perf_counter()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    for f in Path(base).iterdir():  # a complete model directory: the tokenizer files come along
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, Path(out) / f.name)
    return {"imports_ms": (t1 - t0) * 1000, "merge_save_ms": (time.perf_counter() - t1) * 1000}


def make_adapters(base: str, out: str, count: int) -> None:
    """`count` random LoRA adapters (r=16 on the seven projections) whose B matrices are nonzero."""
    from tandem_trainer.tiny_model import build_random_adapter

    for i in range(1, count + 1):
        build_random_adapter(base, Path(out) / f"v{i:06d}", rank=RANDOM_ADAPTER_RANK, seed=i, scale=0.05)


def rank(adapter: Path) -> int:
    """The largest LoRA rank of an adapter (`r`, or a larger one in its `rank_pattern`)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    return max([int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())])
