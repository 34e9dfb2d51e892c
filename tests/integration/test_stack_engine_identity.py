"""Two stacks started together: the engine that answers on this stack's port must be its own."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.loopback import serve_app

from tandem.dev.composition import StackConfig
from tandem.dev.ports import free_port
from tandem.dev.stack import Stack
from tandem.errors import StackError
from tandem.settings import EngineSettings
from tandem_inference.engines.transformers.server import create_engine_app

pytestmark = pytest.mark.integration


def test_another_stacks_engine_on_the_port_is_never_taken_for_this_ones(tiny_model: Path, tmp_path: Path) -> None:
    ours = Stack(StackConfig(state_dir=tmp_path / "b", model=str(tiny_model), gateway_port=0, redis_port=0,
                             engine_port=free_port(30000, 31000)))
    engine = next(svc for svc in ours.plan() if svc.name == "engine")  # its probe, as the stack waits on it
    foreign = EngineSettings(model=str(tiny_model), device="cpu", admin_api_key="the-other-stacks-key")
    with serve_app(create_engine_app(foreign), port=ours.engine_port):
        with pytest.raises(StackError, match="refuses this stack's admin key: another tandem stack"):
            engine.ready()
    own = EngineSettings(model=str(tiny_model), device="cpu", admin_api_key=ours.secrets["engine_admin_key"])
    with serve_app(create_engine_app(own), port=ours.engine_port):
        assert engine.ready()


def test_ports_in_a_range_are_picked_from_a_random_start() -> None:
    picks = {free_port(30000, 31000) for _ in range(20)}
    assert len(picks) > 1 and all(30000 <= p < 31000 for p in picks)
