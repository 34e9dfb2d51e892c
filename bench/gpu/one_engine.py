"""One engine server as tandem starts it, for the GPU scripts that check an engine alone.

`settings` makes the inference settings of SGLang on GPU 0 with the benchmarks' kernels, or,
for a dry run of a script on a CPU, of the transformers engine (which reads its own settings
from the environment); `serving` starts that engine with tandem's launcher and yields its
client and boot time, and stops it on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.benchlib import SHAPES, sglang_flags
from tandem.settings import EngineSettings, InferenceSettings
from tandem_inference.engines import connect, own_engine
from tandem_inference.engines.base import Engine
from tandem_inference.engines.launcher import Launcher


def add_arguments(parser: argparse.ArgumentParser, *, port: int) -> None:
    """The options every such script takes: where results go, which engine, its interpreter, shape and port."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine", choices=["sglang", "transformers"], default="sglang",
                        help="transformers: a dry run of the script on a CPU")
    parser.add_argument("--sglang-python", default="python3")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--port", type=int, default=port)


def settings(kind: str, model: Path, adapters: Path, *, port: int, sglang_python: str = "python3",
             extra_args: tuple[str, ...] = (), kernels: str = "bench", **engine: Any) -> InferenceSettings:
    """SGLang (`kind` "sglang") on GPU 0 at half its memory, with the pinned kernels of
    `bench.benchlib.SGLANG_KERNELS` or, `kernels` "shipped", those SGLang picks itself; or the
    transformers engine on the CPU serving adapters under `adapters`. `engine` holds more
    EngineSettings fields."""
    url = f"http://127.0.0.1:{port}"
    if kind == "sglang":
        eng = EngineSettings(kind="sglang", model=str(model), url=url, sglang_python=sglang_python, max_lora_rank=16,
                             extra_args=[*sglang_flags(kernels), *extra_args], mem_fraction_static=0.5,
                             **engine)
        return InferenceSettings(engine=eng, gpus={"mode": "split", "inference": [0], "trainer": [1]})
    os.environ.update({"TANDEM_ENGINE__MODEL": str(model), "TANDEM_ENGINE__PORT": str(port),
                       "TANDEM_ENGINE__DEVICE": "cpu", "TANDEM_ENGINE__MAX_LORA_RANK": "16",
                       "TANDEM_ENGINE__ADAPTER_ROOTS": json.dumps([str(adapters)])})
    eng = EngineSettings(kind="transformers", launch=True, model=str(model), device="cpu", url=url, max_lora_rank=16,
                         **engine)
    return InferenceSettings(engine=eng, gpus={"mode": "cpu"})


@asynccontextmanager
async def serving(inference: InferenceSettings, http: httpx.AsyncClient,
                  log_path: Path) -> AsyncIterator[tuple[Engine, float, list[str]]]:
    """The engine started by tandem's launcher: (its client, boot seconds, its command line)."""
    own = own_engine(inference)
    assert own is not None, inference.engine.kind
    launcher = Launcher(inference, http, argv=own.argv, env={**own.env, **os.environ}, log_path=log_path)
    boot_s = await launcher.start()
    try:
        yield connect(inference.engine, http), boot_s, own.argv
    finally:
        launcher.stop()
