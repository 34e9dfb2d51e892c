"""The engine seam: engines' wire formats stay inside `engines/`, and each engine is an `Engine`."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import tandem_inference
from tandem_inference.engines import sglang, vllm
from tandem_inference.engines.base import Engine
from tandem_inference.engines.sglang import SGLangEngine
from tandem_inference.engines.transformers import admission
from tandem_inference.engines.transformers.client import TransformersEngine
from tandem_inference.engines.vllm import VLLMEngine

PACKAGE = Path(tandem_inference.__file__).parent
#: Names that exist only in an engine's HTTP API (SGLang's, which the transformers engine serves too, and vLLM's),
#: its metric names among them: the gateway relays an engine's metrics without reading them.
WIRE_NAMES = re.compile(
    r"meta_info|output_token_logprobs|output_top_logprobs|output_ids|sampling_params|lora_path|lora_name"
    r"|logprob_start_len|top_logprobs_num|return_logprob|load_lora_adapter|unload_lora_adapter"
    r"|memory_occupation|/server_info|/generate\b|/flush_cache|update_weights_from_disk"
    r"|return_token_ids|return_tokens_as_token_ids|/wake_up|/reset_prefix_cache|/collective_rpc|\"token_id:"
    r"|\bsglang:|\bvllm:|tandem_engine_"
)


def outside_engines() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "engines" not in p.relative_to(PACKAGE).parts]


def outside_engines_and_tinker() -> list[Path]:
    """The modules that speak no wire but tandem's: the Tinker wing speaks Tinker's API, whose
    names (`sampling_params`) some engines share; it reaches engines through the gateway only."""
    return [p for p in outside_engines() if p.relative_to(PACKAGE).parts[0] != "tinker"]


def test_no_engine_wire_name_outside_the_engines_wing() -> None:
    found = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for p in outside_engines_and_tinker()
             for n, line in enumerate(p.read_text().splitlines(), 1) if WIRE_NAMES.search(line)]
    assert outside_engines() and found == []


def test_gateway_and_controller_import_no_engine_implementation() -> None:
    """They know engines through engines.base (and the factory in main) only."""
    wings = [p for p in outside_engines() if p.relative_to(PACKAGE).parts[0] in ("gateway", "controller")]
    bad = [str(p.relative_to(PACKAGE)) for p in wings
           if re.search(r"tandem_inference\.engines\.(sglang|vllm|transformers|http_errors|launcher)", p.read_text())]
    assert wings and bad == []


def test_each_engine_client_reads_its_own_refusals() -> None:
    """The plumbing every HTTP engine shares holds no engine's words for an adapter it does not hold;
    the transformers engine refuses in SGLang's, which its client (SGLang's) reads."""
    shared = [(PACKAGE / "engines" / name).read_text() for name in ("http.py", "http_errors.py")]
    assert [w for w in (sglang.NOT_LOADED, vllm.NO_SUCH_MODEL) for text in shared if w in text] == []
    assert sglang.NOT_LOADED in admission.NOT_LOADED and issubclass(TransformersEngine, SGLangEngine)


@pytest.mark.parametrize("implementation", [SGLangEngine, TransformersEngine, VLLMEngine])
def test_each_engine_implements_the_protocol_with_its_signatures(implementation: type) -> None:
    members = {name for name, _ in inspect.getmembers(Engine, inspect.isfunction) if not name.startswith("_")}
    assert {"complete", "stream", "load_adapter", "unload_adapter", "loaded_adapters", "health", "info",
            "metrics"} <= members
    for name in members:
        ours, theirs = inspect.signature(getattr(Engine, name)), inspect.signature(getattr(implementation, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        assert inspect.iscoroutinefunction(getattr(Engine, name)) == inspect.iscoroutinefunction(
            getattr(implementation, name)), name
    assert inspect.isasyncgenfunction(implementation.stream)


def test_the_tinker_wing_reaches_engines_through_the_gateway_only() -> None:
    tinker = [p for p in outside_engines() if p.relative_to(PACKAGE).parts[0] == "tinker"]
    bad = [str(p.relative_to(PACKAGE)) for p in tinker if "tandem_inference.engines" in p.read_text()]
    assert tinker and bad == []
