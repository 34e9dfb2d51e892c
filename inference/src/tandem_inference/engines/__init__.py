"""The engines wing: every line that knows an engine's wire format.

    base.py             the `Engine` protocol; `Sampling`, `Generated`, `EngineInfo` in tandem's words
    http.py             any HTTP engine's calls: two pools, timeouts, retries, server-sent events,
                        bounded text (the engine's metrics)
    calls.py            call kinds: timeouts, retries, connection pools
    http_errors.py      engines' error bodies and httpx errors as tandem errors
    sglang.py           SGLang's HTTP API behind `Engine`
    sglang_outputs.py   SGLang's generation replies (whole or streamed) as `Generated`
    sglang_launcher.py  SGLang's command line and environment
    vllm.py             vLLM's HTTP API behind `Engine`
    vllm_outputs.py     vLLM's completion replies (whole or streamed) as `Generated`
    vllm_launcher.py    vLLM's command line and environment
    launcher.py         a replica's own engine as a supervised child process
    transformers/       tandem's transformers engine: its server, and `client.py` behind `Engine`

`connect` picks the implementation for `engine.kind`, `own_engine` the command that starts a
replica's own engine. A new engine is a module here, a value of `engine.kind` and an image.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.acl import without_credentials

if TYPE_CHECKING:
    import httpx

    from tandem.settings import EngineSettings, InferenceSettings
    from tandem_inference.engines.base import Engine


def connect(settings: EngineSettings, http: httpx.AsyncClient, *, admin_http: httpx.AsyncClient | None = None) -> Engine:
    """The client of the engine `settings` names: generation over `http`, the rest over `admin_http`."""
    if settings.kind == "sglang":
        from tandem_inference.engines.sglang import SGLangEngine

        return SGLangEngine.from_settings(http, settings, admin_http=admin_http)
    if settings.kind == "vllm":
        from tandem_inference.engines.vllm import VLLMEngine

        return VLLMEngine.from_settings(http, settings, admin_http=admin_http)
    from tandem_inference.engines.transformers.client import TransformersEngine

    return TransformersEngine.from_settings(http, settings, admin_http=admin_http)


@dataclass(frozen=True)
class OwnEngine:
    """How a replica starts its own engine (engines/launcher.py runs it)."""

    argv: list[str]
    env: dict[str, str]
    log_name: str | None
    """Its log file's name in the store's `logs/` directory; None: this process's own output."""


def own_engine(settings: InferenceSettings) -> OwnEngine | None:
    """This replica's own engine; None when the engine runs elsewhere.

    SGLang and vLLM are always the replica's own; the transformers engine only with `engine.launch`.
    """
    if settings.engine.kind == "sglang":
        from tandem_inference.engines.sglang_launcher import sglang_argv, sglang_env

        return OwnEngine(sglang_argv(settings), sglang_env(settings), log_name="sglang")
    if settings.engine.kind == "vllm":
        from tandem_inference.engines.vllm_launcher import vllm_argv, vllm_env

        return OwnEngine(vllm_argv(settings), vllm_env(settings), log_name="vllm")
    if settings.engine.launch:
        return OwnEngine([sys.executable, "-m", "tandem_inference.engines.transformers"],
                         without_credentials(os.environ), None)
    return None
