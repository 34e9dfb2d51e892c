"""The controller against a real redis-server, the real transformers engine and real adapters.

Adapters are made the way the trainer makes them (tests/helpers/adapters.py): a peft LoRA on the
tiny model saved into a store staging directory, published with a manifest, registered, announced
with adapter_ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers.adapters import announce, publish
from helpers.loopback import serve_app
from prometheus_client import generate_latest

from tandem import keys
from tandem.adapters import AdapterStore
from tandem.deletion import delete_run
from tandem.events import Cursor, Event, EventKind, EventStream, entry_order
from tandem.mounts import is_local
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import (
    ControllerSettings,
    EngineSettings,
    InferenceSettings,
    RedisSettings,
    StoreSettings,
)
from tandem_inference.controller.service import Controller
from tandem_inference.engines.base import Sampling
from tandem_inference.engines.calls import CallKind
from tandem_inference.engines.transformers.client import TransformersEngine
from tandem_inference.engines.transformers.server import create_engine_app
from tandem_inference.errors import EngineResponseError, EngineTimeout, ModelNotFound, Overloaded
from tandem_inference.routing import RoutingTable

pytestmark = pytest.mark.integration

MAX_RANK = 8


# waiting and looking ----------------------------------------------------------------------
async def wait_until(
    pred: Callable[[], bool] | Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def committed_past(conn: redis.Redis, entry_id: str) -> bool:
    """Whether the controller's cursor is at or after stream entry `entry_id`."""

    def key(eid: str) -> tuple[int, int]:
        ms, seq = eid.split("-")
        return int(ms), int(seq)

    return key(Cursor(conn, f"inference:{InferenceSettings().replica.id}").get()) >= key(entry_id)


def events_of(events: EventStream, kind: EventKind, run: str) -> list[Event]:
    return [e for e in events.history(run=run) if e.kind is kind]


# fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    settings = EngineSettings(
        model=str(tiny_model), device="cpu", max_lora_rank=MAX_RANK, max_loaded_adapters=64
    )
    with serve_app(create_engine_app(settings)) as url:
        yield url


@pytest.fixture
def settings(request: pytest.FixtureRequest, redis_url: str, tmp_path: Path, engine_url: str,
             tiny_model: Path) -> InferenceSettings:
    """`controller.check_inline` from an indirect parameter, where a test gives one."""
    return InferenceSettings(
        redis=RedisSettings(url=redis_url),
        store=StoreSettings(root=tmp_path / "store"),
        engine=EngineSettings(url=engine_url, model=str(tiny_model), max_lora_rank=64, max_loaded_adapters=64,
                              unload_timeout_s=10),
        controller=ControllerSettings(block_ms=50, keep_versions=2, check_inline=getattr(request, "param", None)),
    )


@pytest.fixture
async def engine(engine_url: str) -> AsyncIterator[TransformersEngine]:
    async with httpx.AsyncClient() as http:
        yield TransformersEngine(http, engine_url)


@pytest.fixture
def store(settings: InferenceSettings) -> AdapterStore:
    settings.store.root.mkdir(parents=True, exist_ok=True)
    return AdapterStore(settings.store.root)


@pytest.fixture
async def start(
    settings: InferenceSettings, redis_conn: redis.Redis, engine: TransformersEngine, store: AdapterStore
) -> AsyncIterator[Callable[[], Awaitable[Controller]]]:
    """Start a controller (a fresh table each time, like a new process); all are stopped after."""
    started: list[Controller] = []

    async def _start() -> Controller:
        controller = Controller(settings, redis_conn, engine, store, RoutingTable("base"))
        controller.start()
        started.append(controller)
        await wait_until(lambda: controller.reconciled, what="reconcile")
        return controller

    yield _start
    for c in started:
        await c.stop()


# tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", [None, False], ids=["checks-where-the-store-says", "checks-in-a-thread"],
                         indirect=True)
async def test_ready_event_loads_switches_alias_and_announces(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path,
    settings: InferenceSettings,
) -> None:
    controller = await start()
    inline = settings.controller.check_inline
    assert controller.loader.inline_checks is (is_local(store.root) if inline is None else inline)
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    assert controller.table.resolve(run).version == 0  # a known run with no version: the base model

    manifest = publish(store, registry, tiny_model, run, 1)
    ready_id = announce(events, store, manifest)
    await wait_until(lambda: events_of(events, EventKind.ADAPTER_LOADED, run), what="adapter_loaded")

    loaded = events_of(events, EventKind.ADAPTER_LOADED, run)[0]
    assert loaded.version == 1 and loaded.job_id == manifest.job_id
    assert loaded.data["adapter"] == f"{run}-v1" and loaded.data["step"] == 1
    assert loaded.data["load_ms"] > 0 and loaded.data["ready_to_loaded_ms"] >= loaded.data["load_ms"]
    stages = loaded.data["stages_ms"]  # the sync path's stages, each timed on its own
    assert all(stages[k] > 0 for k in ("check", "check_work", "attempt", "verify")) and stages["room"] >= 0
    assert stages["check_work"] <= stages["check"]  # the checks themselves, inside the stage
    assert stages["load_and_verify"] >= max(loaded.data["load_ms"], stages["verify"])
    assert stages["check"] + stages["attempt"] + stages["load_and_verify"] <= loaded.data["ready_to_loaded_ms"]
    # the event's read before the checks, the agreement after the load: the stages follow one another
    assert stages["read"] > 0 and stages["agree"] >= 0
    assert (stages["read"] + stages["check"] + stages["attempt"] + stages["load_and_verify"] + stages["agree"]
            <= loaded.data["ready_to_loaded_ms"])
    assert controller.table.resolve(run).adapter == f"{run}-v1"
    assert registry.serving(run) == 1
    assert json.loads(redis_conn.get(keys.run_loaded(run))) == [1]
    assert (await engine.loaded_adapters())[f"{run}-v1"] == str(store.adapter_dir(run, 1))
    await wait_until(lambda: committed_past(redis_conn, ready_id), what="cursor commit")

    # the adapter is really in use: greedy output under it differs from the base model's
    prompt, greedy = [5, 6, 7, 8], Sampling(max_tokens=6, temperature=0)
    (base,) = await engine.complete(prompt, greedy)
    (tuned,) = await engine.complete(prompt, greedy, adapter=f"{run}-v1")
    assert (base.token_ids, base.logprobs) != (tuned.token_ids, tuned.logprobs)

    metrics = generate_latest(controller.metrics.registry).decode()
    assert f'tandem_adapter_loads_total{{run="{run}"}} 1.0' in metrics
    assert f'tandem_serving_version{{run="{run}"}} 1.0' in metrics
    assert "tandem_adapter_load_seconds_count 1.0" in metrics


@pytest.mark.parametrize("settings", [True, False], ids=["checks-on-the-loop", "checks-in-a-thread"], indirect=True)
async def test_a_failed_look_at_the_engines_adapters_beside_the_checks_costs_only_a_second_look(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch, settings: InferenceSettings,
) -> None:
    """Where the ledger of the engine's adapters is not known, the loader asks for them while it
    checks the files; when that call fails, the slots ask again and the version loads. A version
    that fails its checks cancels its look (a hung engine holds up no rejection; checked on the
    loop, the look never began), and the next version's first attempt keeps the plain name."""
    controller = await start()
    controller.loader.ledger.lost()  # as after a load of unknown outcome: the next load looks
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    real, calls, cancelled = engine.loaded_adapters, [0], [0]
    hang = asyncio.Event()  # set: the engine hangs on this call (never answers)

    async def flaky() -> dict[str, str]:
        calls[0] += 1
        if calls[0] == 1:
            raise EngineResponseError("engine busy", status_code=503)
        if hang.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled[0] += 1
                raise
        return await real()

    monkeypatch.setattr(engine, "loaded_adapters", flaky)
    manifest = publish(store, registry, tiny_model, run, 1)
    announce(events, store, manifest)
    await wait_until(lambda: events_of(events, EventKind.ADAPTER_LOADED, run), what="adapter_loaded")
    assert calls[0] >= 2 and controller.table.resolve(run).adapter == f"{run}-v1"

    bad = publish(store, registry, tiny_model, run, 2)
    (store.adapter_dir(run, 2) / "adapter_config.json").write_text("{not json")
    hang.set()
    asked = calls[0]
    controller.loader.ledger.lost()
    announce(events, store, bad)
    await wait_until(lambda: events_of(events, EventKind.ADAPTER_REJECTED, run), what="adapter_rejected")
    if settings.controller.check_inline:
        assert calls[0] == asked and not cancelled[0]  # refused before the loop ran the look at all
    else:
        await wait_until(lambda: cancelled[0] >= 1, timeout_s=5, what="the rejected version's look cancelled")
    hang.clear()
    good = publish(store, registry, tiny_model, run, 3)
    announce(events, store, good)
    await wait_until(lambda: controller.table.serving(run) == 3, what="v3 serving")
    assert controller.table.resolve(run).adapter == f"{run}-v3"


async def test_a_known_ledger_of_the_engines_adapters_spares_the_look_on_the_way_to_serving(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path,
) -> None:
    """Once the reconcile has read the engine's list, every load and unload keeps the ledger
    (tandem_inference.controller.ledger): a version finds room in it and loads without asking the
    engine for its adapters, and the ledger stays what the engine holds. Unknown again (a load or
    unload of unknown outcome), the next load asks."""
    controller = await start()
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    for version in (1, 2, 3):  # keep_versions=2: v1 is unloaded on the way
        announce(events, store, publish(store, registry, tiny_model, run, version))
        await wait_until(lambda v=version: controller.table.serving(run) == v, what=f"v{version} serving")
    stages = [e.data["stages_ms"] for e in events_of(events, EventKind.ADAPTER_LOADED, run)]
    assert len(stages) == 3 and not any("look" in s for s in stages)
    await wait_until(lambda: f"{run}-v1" not in (controller.loader.ledger.names or {}), what="v1 unloaded")
    assert controller.loader.ledger.names == await engine.loaded_adapters()

    controller.loader.ledger.lost()
    announce(events, store, publish(store, registry, tiny_model, run, 4))
    await wait_until(lambda: controller.table.serving(run) == 4, what="v4 serving")
    assert "look" in events_of(events, EventKind.ADAPTER_LOADED, run)[-1].data["stages_ms"]
    assert controller.loader.ledger.names == await engine.loaded_adapters()


async def test_restart_resumes_from_cursor_and_reconciles(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, tiny_model: Path
) -> None:
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    first = await start()
    ready_id = announce(events, store, publish(store, registry, tiny_model, run, 1))
    await wait_until(lambda: first.table.serving(run) == 1, what="v1 serving")
    await wait_until(lambda: committed_past(redis_conn, ready_id), what="cursor commit")
    await first.stop()

    # while the controller is down: the stream is lost and v2 is only registered (no event)
    redis_conn.delete(keys.EVENTS)
    publish(store, registry, tiny_model, run, 2)

    second = await start()  # fresh table, like a new process; the engine still holds v1
    assert second.table.serving(run) == 2 and second.table.loaded(run) == [1, 2]
    assert registry.serving(run) == 2
    announced = events_of(events, EventKind.ADAPTER_LOADED, run)
    assert [e.version for e in announced] == [2] and announced[0].job_id == f"job-{run}-2"

    # it follows on from the persisted cursor: a new event is handled, nothing old is replayed
    ready3 = announce(events, store, publish(store, registry, tiny_model, run, 3))
    await wait_until(lambda: second.table.serving(run) == 3, what="v3 serving")
    await wait_until(lambda: committed_past(redis_conn, ready3), what="cursor commit")
    assert [e.version for e in events_of(events, EventKind.ADAPTER_LOADED, run)] == [2, 3]


def flip_a_byte(store: AdapterStore, run: str, version: int) -> None:
    weights = store.adapter_dir(run, version) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("bad_checksum", "checksum of adapter/adapter_model.safetensors does not match"),
        ("missing_file", "file adapter/adapter_model.safetensors is missing"),
        ("rank_too_high", f"LoRA rank 16 is above the engine's max_lora_rank {MAX_RANK}"),
        ("outside_store", "outside the adapter store"),
        ("other_version_path", "not the version's adapter directory"),
        ("engine_refuses", "DoRA adapters are not supported"),
        ("config_not_an_object", "adapter_config.json is not a JSON object"),
        ("rank_pattern_not_a_mapping", "adapter_config.json: rank_pattern is not a mapping"),
    ],
)
async def test_bad_versions_are_rejected_and_the_previous_keeps_serving(
    case: str,
    expected: str,
    run: str,
    start,
    redis_conn: redis.Redis,
    store: AdapterStore,
    engine: TransformersEngine,
    tiny_model: Path,
) -> None:
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    controller = await start()
    announce(events, store, publish(store, registry, tiny_model, run, 1))
    await wait_until(lambda: controller.table.serving(run) == 1, what="v1 serving")

    path = None
    if case == "rank_too_high":
        manifest = publish(store, registry, tiny_model, run, 2, rank=16)
    elif case == "engine_refuses":
        manifest = publish(store, registry, tiny_model, run, 2, config_patch={"use_dora": True})
    elif case == "config_not_an_object":
        manifest = publish(store, registry, tiny_model, run, 2, config_text='[{"r": 4}]')
    elif case == "rank_pattern_not_a_mapping":
        manifest = publish(store, registry, tiny_model, run, 2, config_patch={"rank_pattern": [4]})
    else:
        manifest = publish(store, registry, tiny_model, run, 2)
    if case == "bad_checksum":
        flip_a_byte(store, run, 2)
    elif case == "missing_file":
        (store.adapter_dir(run, 2) / "adapter_model.safetensors").unlink()
    elif case == "outside_store":
        path = "../x"
    elif case == "other_version_path":
        path = str(store.adapter_dir(run, 1).relative_to(store.root))
    announce(events, store, manifest, path=path)

    await wait_until(lambda: events_of(events, EventKind.ADAPTER_REJECTED, run), what="adapter_rejected")
    rejected = events_of(events, EventKind.ADAPTER_REJECTED, run)
    assert len(rejected) == 1 and rejected[0].version == 2 and rejected[0].job_id == manifest.job_id
    assert expected in rejected[0].data["message"]
    assert controller.table.serving(run) == 1 and registry.serving(run) == 1
    assert f"{run}-v2" not in await engine.loaded_adapters()
    with pytest.raises(ModelNotFound):
        controller.table.resolve(f"{run}@v2")
    assert [e.version for e in events_of(events, EventKind.ADAPTER_LOADED, run)] == [1]


async def test_old_versions_unload_after_the_keep_window_once_idle(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path
) -> None:
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    controller = await start()
    table = controller.table
    for version in (1, 2):  # one at a time: of versions announced in one read only the newest loads
        announce(events, store, publish(store, registry, tiny_model, run, version))
        await wait_until(lambda v=version: table.serving(run) == v, what=f"v{version} serving")
    await wait_until(lambda: table.loaded(run) == [1, 2], what="v1 and v2 loaded")

    lease = table.checkout(f"{run}@v1")  # a request still running on v1
    announce(events, store, publish(store, registry, tiny_model, run, 3))
    await wait_until(lambda: table.serving(run) == 3, what="v3 serving")
    assert table.loaded(run) == [2, 3]  # v1 left the keep-window: no longer routed ...
    with pytest.raises(ModelNotFound):
        table.resolve(f"{run}@v1")
    await asyncio.sleep(0.5)  # ... but not unloaded while the request holds it
    assert f"{run}-v1" in await engine.loaded_adapters()
    assert json.loads(redis_conn.get(keys.run_loaded(run))) == [2, 3]

    lease.release()
    await wait_until(lambda: _lacks(engine, f"{run}-v1"), what="v1 unloaded")
    held = await engine.loaded_adapters()
    assert f"{run}-v2" in held and f"{run}-v3" in held
    assert controller.status()["retiring"] == []


async def _lacks(engine: TransformersEngine, name: str) -> bool:
    return name not in await engine.loaded_adapters()


async def test_failed_unload_is_retried_and_never_stops_the_controller(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path
) -> None:
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    controller = await start()
    for version in (1, 2, 3):  # one at a time: of versions announced in one read only the newest loads
        announce(events, store, publish(store, registry, tiny_model, run, version))
        await wait_until(lambda v=version: controller.table.serving(run) == v, what=f"v{version} serving")
    await wait_until(lambda: _lacks(engine, f"{run}-v1"), what="v1 unloaded")

    # an engine that fails every unload: the controller logs, backs off and keeps following
    real_unload = engine.unload_adapter
    calls: list[str] = []

    async def failing_unload(name: str) -> None:
        calls.append(name)
        raise EngineTimeout(f"unload of {name} hung")

    engine.unload_adapter = failing_unload  # type: ignore[method-assign]
    announce(events, store, publish(store, registry, tiny_model, run, 4))
    await wait_until(lambda: controller.table.serving(run) == 4, what="v4 serving")
    await wait_until(lambda: calls == [f"{run}-v2"], what="a failed unload attempt")
    assert controller.status()["retiring"] == [f"{run}-v2"]
    assert controller._task is not None and not controller._task.done()

    engine.unload_adapter = real_unload  # type: ignore[method-assign]
    await wait_until(lambda: _lacks(engine, f"{run}-v2"), timeout_s=10, what="v2 unloaded on retry")
    assert controller.status()["retiring"] == []


async def test_adapters_the_engine_lost_are_loaded_again(
    run: str,
    start,
    redis_conn: redis.Redis,
    store: AdapterStore,
    engine: TransformersEngine,
    tiny_model: Path,
) -> None:
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    controller = await start()
    controller.settings.controller.reconcile_s = 0.1
    announce(events, store, publish(store, registry, tiny_model, run, 1))
    await wait_until(lambda: controller.table.serving(run) == 1, what="v1 serving")

    await engine.unload_adapter(f"{run}-v1")  # what an engine restart does to its adapters
    await wait_until(lambda: _holds(engine, f"{run}-v1-a1"), what="v1 loaded again, under a new name")
    assert controller.table.serving(run) == 1 and controller.table.resolve(run).adapter == f"{run}-v1-a1"
    assert [e.version for e in events_of(events, EventKind.ADAPTER_LOADED, run)] == [1]  # not announced twice


async def _holds(engine: TransformersEngine, name: str) -> bool:
    return name in await engine.loaded_adapters()


async def serving_v1(
    start, redis_conn: redis.Redis, store: AdapterStore, tiny_model: Path, run: str
) -> tuple[Controller, Registry, EventStream]:
    """A started controller serving v1 of `run`, and the registry and stream it follows."""
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    controller = await start()
    announce(events, store, publish(store, registry, tiny_model, run, 1))
    await wait_until(lambda: controller.table.serving(run) == 1, what="v1 serving")
    return controller, registry, events


async def test_a_failed_unload_after_bad_checksums_is_retried(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path
) -> None:
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)

    real_unload = engine.unload_adapter
    calls: list[str] = []

    async def unload_failing_once(name: str) -> None:
        calls.append(name)
        if len(calls) == 1:
            raise EngineTimeout(f"unload of {name} hung")
        await real_unload(name)

    engine.unload_adapter = unload_failing_once  # type: ignore[method-assign]
    manifest = publish(store, registry, tiny_model, run, 2)
    flip_a_byte(store, run, 2)  # the engine loads it; the checksums, checked meanwhile, refuse it
    announce(events, store, manifest)
    await wait_until(lambda: events_of(events, EventKind.ADAPTER_REJECTED, run), what="adapter_rejected")
    message = events_of(events, EventKind.ADAPTER_REJECTED, run)[0].data["message"]
    assert "checksum of adapter/adapter_model.safetensors" in message
    await wait_until(lambda: _lacks(engine, f"{run}-v2"), timeout_s=10, what="v2 unloaded on retry")
    assert calls[:2] == [f"{run}-v2", f"{run}-v2"]
    assert controller.table.serving(run) == 1 and controller.table.loaded(run) == [1]
    await wait_until(lambda: controller.status()["retiring"] == [], what="nothing left to retire")


async def test_an_adapter_the_engine_holds_is_adopted_only_if_its_files_check_out(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path
) -> None:
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    first = await start()
    for version in (1, 2):  # one at a time: of versions announced in one read only the newest loads
        announce(events, store, publish(store, registry, tiny_model, run, version))
        await wait_until(lambda v=version: first.table.serving(run) == v, what=f"v{version} serving")
    await first.stop()

    flip_a_byte(store, run, 2)  # damaged on the volume while the controller was down
    second = await start()  # the engine still holds v1 and v2
    assert second.table.serving(run) == 1 and second.table.loaded(run) == [1]
    rejected = events_of(events, EventKind.ADAPTER_REJECTED, run)
    assert [e.version for e in rejected] == [2] and "checksum" in rejected[0].data["message"]
    await wait_until(lambda: _lacks(engine, f"{run}-v2"), what="the damaged v2 unloaded")
    assert second.table.resolve(run).version == 1


async def test_a_routed_version_is_never_unloaded_even_if_an_earlier_check_queued_it(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path
) -> None:
    controller, _, _ = await serving_v1(start, redis_conn, store, tiny_model, run)
    controller.unloader.add(f"{run}-v1", run, 1, routed=False)  # what a failed check of v1 leaves
    await controller.unload_retired()
    assert f"{run}-v1" in await engine.loaded_adapters()
    assert controller.status()["retiring"] == [] and controller.table.serving(run) == 1


def record_loads(engine: TransformersEngine) -> list[str]:
    """Names of every adapter load the engine is asked for from now on (the loads still happen)."""
    names: list[str] = []
    real_load = engine.load_adapter

    async def load(name: str, path: str) -> float:
        names.append(name)
        return await real_load(name, path)

    engine.load_adapter = load  # type: ignore[method-assign]
    return names


#: Stream entries that do not parse, one of each shape.
MALFORMED: list[dict[str, str | bytes]] = [
    {"run": "x", "ts": "1"},  # no kind
    {"kind": "adapter_loaded_maybe", "run": "x", "ts": "1"},
    {"kind": "adapter_ready", "ts": "1", "version": "1"},  # no run
    {"kind": "adapter_ready", "run": "x", "version": "1"},  # no ts
    {"kind": "adapter_ready", "run": "x", "ts": "soon"},
    {"kind": "adapter_ready", "run": "x", "ts": "nan"},
    {"kind": "adapter_ready", "run": "x", "ts": "1", "version": "two"},
    {"kind": "adapter_ready", "run": "x", "ts": "1", "version": "-3"},
    {"kind": "adapter_ready", "run": "x", "ts": "1", "version": "\u00b2"},  # a digit, but not 0-9
    {"kind": "adapter_ready", "run": "x", "ts": "1", "version": "9" * 5000},
    {"kind": "adapter_ready", "run": "x", "ts": "1", "data": "{not json"},
    {"kind": "adapter_ready", "run": "x", "ts": "1", "data": "[1, 2]"},
    {"kind": "adapter_ready", "run": "x", "ts": "1", "data": "[" * 100_000},
    {"kind": b"adapter_ready\xff", "run": "x", "ts": "1"},  # not UTF-8
]


def hostile_events(run: str) -> list[Event]:
    """Entries that parse but carry what no trainer writes."""
    ready = EventKind.ADAPTER_READY
    return [
        Event(kind=ready, run="../../etc", version=1, data={"path": "../../etc"}),
        Event(kind=ready, run="r" * 100_000, version=1),
        Event(kind=ready, run="ghost", version=1, data={"path": "ghost/v000001/adapter"}),
        Event(kind=ready, run=run, version=7, data={"path": "../../../../etc"}),
        Event(kind=ready, run=run, version=7, data={"path": 12}),
        Event(kind=ready, run=run, version=7, data={"path": "a\x00b"}),
        Event(kind=ready, run=run, version=0),
        Event(kind=ready, run=run, version=7, data={"blob": "x" * 2_000_000}),
        Event(kind=EventKind.TRAIN_FAILED, run=run, data={"message": "m" * 1_000_000}),
    ]


async def test_malformed_and_hostile_entries_are_skipped_and_the_next_version_loads_promptly(
    run: str,
    start,
    redis_conn: redis.Redis,
    store: AdapterStore,
    tiny_model: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    controller = await start()
    for fields in MALFORMED:
        redis_conn.xadd(keys.EVENTS, fields)  # type: ignore[arg-type]
    for event in hostile_events(run):
        events.append(event)
    ready_id = announce(events, store, publish(store, registry, tiny_model, run, 1))

    await wait_until(lambda: controller.table.serving(run) == 1, timeout_s=10, what="v1 serving")
    await wait_until(lambda: committed_past(redis_conn, ready_id), what="cursor past every entry")
    metrics = generate_latest(controller.metrics.registry).decode()
    assert f"tandem_controller_malformed_events_total {float(len(MALFORMED))}" in metrics
    assert controller._task is not None and not controller._task.done()
    assert not [r for r in caplog.records if "controller failed" in r.getMessage()]
    assert controller.table.runs() == [run]  # no entry made up a run
    rejected = {e.version for e in events_of(events, EventKind.ADAPTER_REJECTED, run)}
    assert rejected == {0, 7}


async def test_a_registered_version_never_announced_is_loaded_by_the_periodic_reconcile(
    run: str,
    start,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    store: AdapterStore,
    engine: TransformersEngine,
    tiny_model: Path,
) -> None:
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    settings.controller.reconcile_s = 0.2
    loads = record_loads(engine)

    manifest = publish(store, registry, tiny_model, run, 2)  # registered; the trainer died before announcing
    await wait_until(lambda: controller.table.serving(run) == 2, timeout_s=10, what="v2 serving")
    loaded = events_of(events, EventKind.ADAPTER_LOADED, run)
    assert [(e.version, e.job_id) for e in loaded] == [(1, f"job-{run}-1"), (2, manifest.job_id)]
    assert loads == [f"{run}-v2"]

    # the trainer's retry announces it after all: harmless, and a waiting client hears it serves
    ready_id = announce(events, store, manifest)
    await wait_until(lambda: committed_past(redis_conn, ready_id), what="cursor commit")
    await wait_until(lambda: len(events_of(events, EventKind.ADAPTER_LOADED, run)) == 3, what="re-announced")
    assert events_of(events, EventKind.ADAPTER_LOADED, run)[-1].version == 2
    assert loads == [f"{run}-v2"] and not events_of(events, EventKind.ADAPTER_REJECTED, run)
    assert controller.table.loaded(run) == [1, 2] and controller.status()["retiring"] == []


class PeriodicReconciles:
    """Wraps a controller's periodic reconcile (the one its follow loop runs between reads of the
    stream) to run `before` once, at the start of the next one, and to record what each loaded."""

    def __init__(self, controller: Controller, loads: list[str], before: Callable[[], None]) -> None:
        self.loads, self.before = loads, before
        self.loaded_by: list[list[str]] = []
        """The engine loads each periodic reconcile made, one list per reconcile since the first `before`."""
        self._real = controller.reconcile
        controller.reconcile = self.reconcile  # type: ignore[method-assign]

    async def reconcile(self, *, adopt: bool = True, **kwargs: Any) -> None:
        if adopt:
            await self._real(adopt=adopt, **kwargs)
            return
        if not self.loaded_by:
            self.before()  # after the loop's last read of the stream, before this reconcile reads the registry
        first = len(self.loads)
        await self._real(adopt=adopt, **kwargs)
        self.loaded_by.append(self.loads[first:])


async def test_a_version_registered_and_announced_while_the_loop_reconciles_loads_from_its_event_once(
    run: str, start, settings: InferenceSettings, redis_conn: redis.Redis, store: AdapterStore,
    engine: TransformersEngine, tiny_model: Path,
) -> None:
    """The race of issue 42: the trainer registers a version and appends its adapter_ready between the
    follow loop's read and its periodic reconcile. The reconcile finds the version registered with the
    event unread: it leaves it to the event, which loads it on the fast path; one load, one
    adapter_loaded."""
    settings.controller.reconcile_s = 0.05  # a periodic reconcile after nearly every read
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    loads = record_loads(engine)
    manifest = publish(store, None, tiny_model, run, 2)  # the files only: registered and announced below
    ready_ids: list[str] = []

    def trainer_publishes() -> None:
        registry.register_version(manifest)
        ready_ids.append(announce(events, store, manifest))

    reconciles = PeriodicReconciles(controller, loads, trainer_publishes)
    await wait_until(lambda: controller.table.serving(run) == 2, what="v2 serving")
    await wait_until(lambda: committed_past(redis_conn, ready_ids[0]), what="cursor past the adapter_ready")
    await wait_until(lambda: len(reconciles.loaded_by) >= 3, what="two more periodic reconciles")

    assert reconciles.loaded_by[0] == []  # the reconcile that saw it first left it to its event
    assert loads == [f"{run}-v2"]  # loaded once, by the event
    loaded = [e for e in events_of(events, EventKind.ADAPTER_LOADED, run) if e.version == 2]
    assert len(loaded) == 1 and loaded[0].job_id == manifest.job_id
    assert loaded[0].id is not None and entry_order(loaded[0].id) > entry_order(ready_ids[0])
    assert not events_of(events, EventKind.ADAPTER_HELD, run)  # the reconcile's path announces held versions
    assert controller.table.loaded(run) == [1, 2] and registry.serving(run) == 2


async def test_a_controller_behind_the_trainer_loads_a_runs_newest_version_and_skips_the_ones_it_overtook(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path,
) -> None:
    """While a slow load of another run holds the loop, the trainer publishes v2 and v3 of the run: the
    next read of the stream finds both adapter_ready events, and only v3 is loaded and announced (a
    controller behind the trainer loads each run's newest version, not every one it missed)."""
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    other, gate, real_load = f"{run}-b", asyncio.Event(), engine.load_adapter

    async def held_load(name: str, path: str) -> float:
        if name.startswith(f"{other}-v1"):
            await gate.wait()
        return await real_load(name, path)

    engine.load_adapter = held_load  # type: ignore[method-assign]
    loads = record_loads(engine)
    registry.create_run(RunSpec(name=other, base_model=str(tiny_model)))
    announce(events, store, publish(store, registry, tiny_model, other, 1))
    await wait_until(lambda: any(n.startswith(f"{other}-v1") for n in loads), what="the other run's load begun")
    for version in (2, 3):
        announce(events, store, publish(store, registry, tiny_model, run, version))
    gate.set()
    await wait_until(lambda: controller.table.serving(run) == 3, what="v3 serving")

    assert [n for n in loads if n.startswith(f"{run}-v")] == [f"{run}-v3"]
    assert [e.version for e in events_of(events, EventKind.ADAPTER_LOADED, run)] == [1, 3]
    assert controller.table.serving(other) == 1 and registry.serving(run) == 3


async def test_a_version_announced_while_the_reconcile_loads_it_is_announced_once(
    run: str, start, settings: InferenceSettings, redis_conn: redis.Redis, store: AdapterStore,
    engine: TransformersEngine, tiny_model: Path,
) -> None:
    """The trainer registered the version and the periodic reconcile began loading it before the
    adapter_ready was appended: the reconcile's announcement comes after the event in the stream (a
    client waiting from its adapter_ready hears it), so the event loads nothing and announces nothing."""
    settings.controller.reconcile_s = 0.05
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    loads = record_loads(engine)
    manifest = publish(store, None, tiny_model, run, 2)
    ready_ids: list[str] = []
    real_load = engine.load_adapter

    async def load_then_the_trainer_announces(name: str, path: str) -> float:
        if name == f"{run}-v2" and not ready_ids:
            ready_ids.append(announce(events, store, manifest))  # the trainer's second write lands now
        return await real_load(name, path)

    engine.load_adapter = load_then_the_trainer_announces  # type: ignore[method-assign]
    reconciles = PeriodicReconciles(controller, loads, lambda: registry.register_version(manifest))
    await wait_until(lambda: controller.table.serving(run) == 2, what="v2 serving")
    await wait_until(lambda: bool(ready_ids) and committed_past(redis_conn, ready_ids[0]),
                     what="cursor past the adapter_ready")
    await wait_until(lambda: len(reconciles.loaded_by) >= 3, what="two more periodic reconciles")

    assert reconciles.loaded_by[0] == [f"{run}-v2"] and loads == [f"{run}-v2"]  # the safety net loaded it, once
    loaded = [e for e in events_of(events, EventKind.ADAPTER_LOADED, run) if e.version == 2]
    assert len(loaded) == 1 and loaded[0].job_id == manifest.job_id
    assert loaded[0].id is not None and entry_order(loaded[0].id) > entry_order(ready_ids[0])
    assert controller.table.loaded(run) == [1, 2] and registry.serving(run) == 2


async def test_an_adapter_ready_appended_during_the_reconcile_is_seen_before_its_version_would_load(
    run: str, start, settings: InferenceSettings, redis_conn: redis.Redis, store: AdapterStore,
    engine: TransformersEngine, tiny_model: Path,
) -> None:
    """One periodic reconcile, two runs: it loads the first run's v2, registered with no event (the
    safety net); while that load runs, the second run's trainer publishes v1 (registered, then
    adapter_ready). Before loading that one the reconcile reads on in the stream, finds its event
    and leaves it to it."""
    settings.controller.reconcile_s = 0.05
    later = f"{run}z"  # reconciled after `run` (runs go in name order)
    Registry(redis_conn).create_run(RunSpec(name=later, base_model=str(tiny_model)))
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    loads = record_loads(engine)
    orphan, other = publish(store, None, tiny_model, run, 2), publish(store, None, tiny_model, later, 1)
    ready_ids: list[str] = []
    recorded_load = engine.load_adapter

    async def load_while_the_other_trainer_publishes(name: str, path: str) -> float:
        if name == f"{run}-v2" and not ready_ids:
            registry.register_version(other)
            ready_ids.append(announce(events, store, other))
        return await recorded_load(name, path)

    engine.load_adapter = load_while_the_other_trainer_publishes  # type: ignore[method-assign]
    reconciles = PeriodicReconciles(controller, loads, lambda: registry.register_version(orphan))
    await wait_until(lambda: controller.table.serving(run) == 2 and controller.table.serving(later) == 1,
                     what="both versions serving")
    await wait_until(lambda: bool(ready_ids) and committed_past(redis_conn, ready_ids[0]),
                     what="cursor past the adapter_ready")
    await wait_until(lambda: len(reconciles.loaded_by) >= 3, what="two more periodic reconciles")

    assert reconciles.loaded_by[0] == [f"{run}-v2"]  # the other run's version was left to its event
    assert sorted(loads) == sorted([f"{run}-v2", f"{later}-v1"])  # each loaded once
    assert [e.version for e in events_of(events, EventKind.ADAPTER_LOADED, later)] == [1]
    assert [e.version for e in events_of(events, EventKind.ADAPTER_LOADED, run)] == [1, 2]


async def test_a_version_the_store_showed_late_is_loaded_once_it_appears_and_a_bad_one_never(
    run: str,
    start,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    store: AdapterStore,
    engine: TransformersEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """A shared store (NFS) may show a new version late: "no directory" is transient and retried
    with backoff; a checksum failure is final until the version is registered anew."""
    import shutil

    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    settings.controller.reconcile_s = 0.2
    manifest = publish(store, registry, tiny_model, run, 2)
    hidden = tmp_path / "not-yet-visible"
    shutil.move(store.version_dir(run, 2), hidden)
    announce(events, store, manifest)
    await wait_until(lambda: len(events_of(events, EventKind.ADAPTER_REJECTED, run)) >= 1, what="refused once")
    assert "no directory" in events_of(events, EventKind.ADAPTER_REJECTED, run)[0].data["message"]
    assert (run, 2) in controller.loader.retries and (run, 2) not in controller.loader.rejected
    shutil.move(hidden, store.version_dir(run, 2))  # the store catches up
    await wait_until(lambda: controller.table.serving(run) == 2, timeout_s=15, what="v2 serving once visible")
    assert (run, 2) not in controller.loader.retries

    corrupt = publish(store, registry, tiny_model, run, 3)
    weights = store.adapter_dir(run, 3) / "adapter_model.safetensors"
    weights.write_bytes(b"\0" + weights.read_bytes()[1:])
    announce(events, store, corrupt)
    await wait_until(lambda: (run, 3) in controller.loader.rejected, what="v3 refused for good")
    refusals = len(events_of(events, EventKind.ADAPTER_REJECTED, run))
    await asyncio.sleep(1.5)  # several periodic reconciles: none tries v3 again
    assert len(events_of(events, EventKind.ADAPTER_REJECTED, run)) == refusals and controller.table.serving(run) == 2


def symlink_out(store: AdapterStore, run: str, version: int, what: str, outside: Path) -> None:
    """Replace the version directory or its weights file by a symlink to a copy outside the store."""
    import shutil

    target = store.version_dir(run, version) if what == "version_dir" else (
        store.adapter_dir(run, version) / "adapter_model.safetensors")
    moved = outside / f"{what}-{run}-{version}"
    shutil.move(target, moved)
    target.symlink_to(moved)


@pytest.mark.parametrize("how", ["event", "reconcile"])
@pytest.mark.parametrize("what", ["version_dir", "weights_file"])
async def test_a_symlink_out_of_the_store_is_refused_before_the_engine_sees_it(
    what: str,
    how: str,
    run: str,
    start,
    redis_conn: redis.Redis,
    store: AdapterStore,
    engine: TransformersEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    loads = record_loads(engine)
    manifest = publish(store, registry, tiny_model, run, 2)
    symlink_out(store, run, 2, what, tmp_path)
    if how == "event":
        announce(events, store, manifest)
    else:  # found registered by a restarted controller
        await controller.stop()
        controller = await start()

    await wait_until(lambda: events_of(events, EventKind.ADAPTER_REJECTED, run), what="adapter_rejected")
    message = events_of(events, EventKind.ADAPTER_REJECTED, run)[0].data["message"]
    assert "outside the adapter store" in message
    assert loads == []  # the engine never opened it
    assert controller.table.serving(run) == 1
    assert not [n for n in await engine.loaded_adapters() if n.startswith(f"{run}-v2")]


async def test_a_name_once_given_to_the_engine_is_never_given_again(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path
) -> None:
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    loads = record_loads(engine)
    manifest = publish(store, registry, tiny_model, run, 2)
    flip_a_byte(store, run, 2)  # torn: the engine loads it while its checksums are checked, then it goes
    announce(events, store, manifest)
    await wait_until(lambda: events_of(events, EventKind.ADAPTER_REJECTED, run), what="adapter_rejected")
    await wait_until(lambda: _lacks(engine, f"{run}-v2"), what="the torn v2 unloaded")
    assert loads == [f"{run}-v2"]

    # a restarted trainer moves the torn v2 aside and writes v2 again
    vdir = store.version_dir(run, 2)
    vdir.rename(vdir.with_name(f".tmp-rejected-{vdir.name}"))
    announce(events, store, publish(store, registry, tiny_model, run, 2))
    await wait_until(lambda: controller.table.serving(run) == 2, what="the new v2 serving")
    assert loads == [f"{run}-v2", f"{run}-v2-a1"]
    assert controller.table.resolve(run).adapter == f"{run}-v2-a1"
    # the alias switches before `adapter_loaded` is appended: wait for the event itself
    await wait_until(lambda: events_of(events, EventKind.ADAPTER_LOADED, run)[-1].version == 2,
                     what="v2's adapter_loaded")
    assert events_of(events, EventKind.ADAPTER_LOADED, run)[-1].data["adapter"] == f"{run}-v2-a1"
    assert f"{run}-v2-a1" in await engine.loaded_adapters()

    # a new controller adopts what the engine holds under the suffixed name, and never reuses it
    await controller.stop()
    controller.settings.controller.reconcile_s = 0.2  # the second's first periodic reconcile comes soon
    second = await start()
    assert second.table.loaded(run) == [1, 2] and second.table.resolve(f"{run}@v2").adapter == f"{run}-v2-a1"
    assert loads == [f"{run}-v2", f"{run}-v2-a1"]
    await engine.unload_adapter(f"{run}-v2-a1")  # lost by the engine: loaded again, under a new name
    await wait_until(lambda: second.table.resolve(run).adapter == f"{run}-v2-a2", timeout_s=10,
                     what="v2 loaded again")
    assert f"{run}-v2-a2" in await engine.loaded_adapters()


async def test_a_version_adopted_at_start_up_and_evicted_before_its_adapter_ready_is_read_is_announced(
    redis_conn: redis.Redis, settings: InferenceSettings, store: AdapterStore, tiny_model: Path
) -> None:
    """The inference service killed after the engine loaded a version and before `adapter_loaded`: the
    restarted controller adopts what the engine holds, a full engine evicts it for another run's
    version, and then the version's `adapter_ready` is read. It must be loaded and announced, or a
    `train()` waiting for it waits out its whole timeout while the version serves."""
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    a, b = (f"adopt{uuid.uuid4().hex[:6]}{x}" for x in "ab")
    for name in (a, b):
        registry.create_run(RunSpec(name=name, base_model=str(tiny_model)))
    # what the killed controller left: its cursor before a v1's adapter_ready, a v1 in the engine
    # under the name its load attempt gave, and no adapter_loaded
    Cursor(redis_conn, f"{settings.controller.consumer}:{settings.replica.id}").commit("0-0")
    manifest = publish(store, registry, tiny_model, a, 1)
    announce(events, store, manifest)
    assert registry.next_load_attempt(a, 1) == 0
    publish(store, registry, tiny_model, b, 1)  # registered, never announced: the start-up reconcile loads it
    one = EngineSettings(model=str(tiny_model), device="cpu", max_lora_rank=MAX_RANK, max_loaded_adapters=1)
    with serve_app(create_engine_app(one)) as url:
        async with httpx.AsyncClient() as http:
            engine = TransformersEngine(http, url)
            await engine.load_adapter(f"{a}-v1", str(store.adapter_dir(a, 1)))
            limited = settings.model_copy(update={
                "engine": settings.engine.model_copy(update={"url": url, "max_loaded_adapters": 1})})
            controller = Controller(limited, redis_conn, engine, store, RoutingTable("base"))
            controller.start()
            try:
                await wait_until(lambda: events_of(events, EventKind.ADAPTER_LOADED, a), timeout_s=20,
                                 what="a v1's adapter_loaded")
                [loaded] = events_of(events, EventKind.ADAPTER_LOADED, a)
                assert loaded.version == 1 and loaded.job_id == manifest.job_id
                assert loaded.data["adapter"] == f"{a}-v1-a1"  # loaded again under a fresh name
                assert controller.table.serving(a) == 1 and registry.serving(a) == 1
                assert controller.table.serving(b) == 1  # b's v1 serves too, evicted or not
                assert not events_of(events, EventKind.ADAPTER_REJECTED, a)
            finally:
                await controller.stop()


async def test_a_forged_ready_for_an_unregistered_run_makes_no_run(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path
) -> None:
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    loads = record_loads(engine)
    forged = events.append(Event(kind=EventKind.ADAPTER_READY, run="ghost", version=1,
                                 data={"path": "ghost/v000001/adapter"}))
    await wait_until(lambda: committed_past(redis_conn, forged), what="cursor commit")
    assert not controller.table.has_run("ghost") and "ghost" not in controller.table.known_models()
    rejected = events_of(events, EventKind.ADAPTER_REJECTED, "ghost")
    assert len(rejected) == 1 and "no run 'ghost' is registered" in rejected[0].data["message"]
    with pytest.raises(ModelNotFound):
        controller.table.resolve("ghost")
    assert loads == []


async def test_a_load_that_completes_after_its_timeout_is_unloaded_as_a_stray(
    run: str,
    start,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    store: AdapterStore,
    engine: TransformersEngine,
    tiny_model: Path,
) -> None:
    settings.controller.reconcile_s = 0.2
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    v3 = publish(store, registry, tiny_model, run, 3, register=False)  # written now, registered later
    load_timeout_s = engine.timeouts_s[CallKind.LOAD]
    engine.timeouts_s[CallKind.LOAD] = 0.3

    # a long generation holds the engine; a load asked for meanwhile outlasts its timeout
    long = engine.stream([5, 6, 7], Sampling(max_tokens=1000, ignore_eos=True, temperature=0))
    await long.__anext__()
    ready2 = announce(events, store, publish(store, registry, tiny_model, run, 2))
    await wait_until(lambda: committed_past(redis_conn, ready2), what="v2's load given up")
    assert controller.table.serving(run) == 1

    # v3 comes, the engine frees up: v2's load completes late, in the engine only
    engine.timeouts_s[CallKind.LOAD] = load_timeout_s
    loads = record_loads(engine)
    registry.register_version(v3)
    announce(events, store, v3)
    await wait_until(lambda: loads == [f"{run}-v3"], what="v3's load asked for")
    await long.aclose()
    await wait_until(lambda: controller.table.serving(run) == 3, what="v3 serving")
    await wait_until(lambda: _lacks(engine, f"{run}-v2"), timeout_s=15, what="the late v2 unloaded")
    assert controller.table.loaded(run) == [1, 3]
    held = await engine.loaded_adapters()
    assert {n for n in held if n.startswith(run)} == {f"{run}-v1", f"{run}-v3"}
    metrics = generate_latest(controller.metrics.registry).decode()
    assert f'tandem_adapter_load_timeouts_total{{run="{run}"}} 1.0' in metrics
    assert f'tandem_adapter_strays_total{{run="{run}"}} 1.0' in metrics  # the engine did hold the late v2


async def test_a_timed_out_load_is_sent_again_once_the_engine_restarted(
    run: str,
    start,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    store: AdapterStore,
    engine: TransformersEngine,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load that timed out is not sent again while it may still complete in the engine, but an
    engine that restarted runs none of the earlier loads: the version is loaded anew."""
    import tandem_inference.controller.loading as adapter_loading

    monkeypatch.setattr(adapter_loading, "PENDING_LOAD_TIMEOUTS", 10_000)  # never retried by waiting
    settings.controller.reconcile_s = 0.2
    controller, registry, events = await serving_v1(start, redis_conn, store, tiny_model, run)
    real_load, hung = engine.load_adapter, []

    async def load(name: str, path: str) -> float:
        if name.startswith(f"{run}-v2") and not hung:  # the engine hangs on this load, then restarts
            hung.append(name)
            raise EngineTimeout(f"load of {name} timed out")
        return await real_load(name, path)

    engine.load_adapter = load  # type: ignore[method-assign]
    ready2 = announce(events, store, publish(store, registry, tiny_model, run, 2))
    await wait_until(lambda: committed_past(redis_conn, ready2), what="v2's load given up")
    assert hung and controller.table.serving(run) == 1
    await engine.unload_adapter(f"{run}-v1")  # what an engine restart does to its adapters
    await wait_until(lambda: controller.table.serving(run) == 2, timeout_s=20, what="v2 loaded after the restart")


async def test_an_engine_that_refuses_loads_with_503_is_not_asked_again_at_once(
    run: str,
    settings: InferenceSettings,
    redis_conn: redis.Redis,
    store: AdapterStore,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine healthy by /health that answers 503 to a load: the controller pauses before it
    starts over, so it neither spins nor uses up a name for the version each time round."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    import tandem_inference.controller.service as controller_module

    monkeypatch.setattr(controller_module, "RESTART_PAUSE_S", 60.0)  # no second try within the test
    loads: list[str] = []
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/v1/models")(lambda: {"object": "list", "data": []})
    app.get("/server_info")(lambda: {"max_lora_rank": MAX_RANK})

    @app.post("/load_lora_adapter")
    async def load(body: dict) -> JSONResponse:
        loads.append(body["lora_name"])
        return JSONResponse({"error": {"message": "the engine is busy"}}, status_code=503)

    publish(store, Registry(redis_conn), tiny_model, run, 1)
    with serve_app(app) as url:
        async with httpx.AsyncClient() as http:
            engine = TransformersEngine(http, url, max_attempts=1)
            controller = Controller(settings, redis_conn, engine, store, RoutingTable("base"))
            controller.start()
            try:
                await wait_until(lambda: loads, what="the first load")
                await asyncio.sleep(0.5)  # a controller that does not pause asks hundreds of times here
            finally:
                await controller.stop()
    assert loads == [f"{run}-v1"]
    assert int(redis_conn.hget(keys.run_load_attempts(run), "1")) == 1  # one name used up, not hundreds
    assert controller.table.serving(run) == 0


@asynccontextmanager
async def three_slot_controller(redis_conn: redis.Redis, settings: InferenceSettings, store: AdapterStore,
                                tiny_model: Path, prefix: str,
                                **controller: Any) -> AsyncIterator[tuple[Controller, TransformersEngine, list[str]]]:
    """A started controller in front of a CPU engine of 3 adapter slots, and four registered runs."""
    registry = Registry(redis_conn)
    runs = [f"{prefix}{uuid.uuid4().hex[:6]}{x}" for x in "abcd"]
    for name in runs:
        registry.create_run(RunSpec(name=name, base_model=str(tiny_model)))
    small = EngineSettings(model=str(tiny_model), device="cpu", max_lora_rank=MAX_RANK, max_loaded_adapters=3)
    with serve_app(create_engine_app(small)) as url:
        async with httpx.AsyncClient() as http:
            engine = TransformersEngine(http, url)
            limited = settings.model_copy(update={
                "engine": settings.engine.model_copy(update={"url": url, "max_loaded_adapters": 3}),
                "controller": settings.controller.model_copy(update=controller)})
            started = Controller(limited, redis_conn, engine, store, RoutingTable("base"))
            started.start()
            try:
                yield started, engine, runs
            finally:
                await started.stop()


async def test_an_adapter_the_ledger_missed_costs_a_second_try_not_a_rejection(
    redis_conn: redis.Redis, settings: InferenceSettings, store: AdapterStore, tiny_model: Path
) -> None:
    """The ledger misses an adapter the controller did not load (here one loaded past it; in life a
    load whose outcome it never saw, landed late): it shows room in a full engine, the engine
    refuses the load, and the loader makes room from the engine's own list and loads again. The
    version serves and nothing is rejected."""
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    async with three_slot_controller(redis_conn, settings, store, tiny_model, "missed", reconcile_s=3600) as (
            controller, engine, (a, b, c, _)):
        await wait_until(lambda: controller.reconciled, what="reconcile")
        for run in (a, b):
            announce(events, store, publish(store, registry, tiny_model, run, 1))
            await wait_until(lambda r=run: controller.table.serving(r) == 1, what=f"{run} v1")
        await engine.load_adapter("loaded-past-tandem", str(store.adapter_dir(a, 1)))  # the engine is full now
        assert len(controller.loader.ledger.names or {}) == 2

        announce(events, store, publish(store, registry, tiny_model, c, 1))
        await wait_until(lambda: controller.table.serving(c) == 1, what="c v1 serving")
        assert not [e for e in events.history() if e.kind is EventKind.ADAPTER_REJECTED]
        held = await engine.loaded_adapters()
        assert f"{c}-v1" in held and len(held) == 3 and f"{a}-v1" not in held  # the least recently used made room
        assert controller.loader.ledger.names == held


async def test_a_full_engine_evicts_the_least_recently_used_idle_adapter_and_loads_on_demand(
    redis_conn: redis.Redis, settings: InferenceSettings, store: AdapterStore, tiny_model: Path
) -> None:
    """Runs share the engine's `max_loaded_adapters`: a new version evicts the least recently used
    adapter no request holds, a run's evicted serving version still is what the run means and is
    loaded again when asked for, and while every slot serves a request a load waits for the one it
    drains, then is refused with a clear 429 when that request does not end in time
    (tandem_inference.controller.slots)."""
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    async with three_slot_controller(redis_conn, settings, store, tiny_model, "full", slot_wait_s=0.5) as (
            controller, engine, (a, b, c, d)):
        table = controller.table
        for run, version in ((a, 1), (a, 2), (b, 1), (b, 2)):  # a v1, the least recently used, makes room
            announce(events, store, publish(store, registry, tiny_model, run, version))
            await wait_until(lambda r=run, v=version: table.serving(r) == v, what=f"{run} v{version}")
        assert table.loaded(a) == [2] and f"{a}-v1" not in await engine.loaded_adapters()

        table.checkout(f"{b}@v1").release()  # b v1 used: a v2 is now the least recently used
        announce(events, store, publish(store, registry, tiny_model, c, 1))
        await wait_until(lambda: table.serving(c) == 1, what="c v1 serving")
        assert sorted(await engine.loaded_adapters()) == sorted([f"{b}-v1", f"{b}-v2", f"{c}-v1"])
        assert table.serving(a) == 2 and table.evicted(a) == [2]  # `a` still means v2, not v1 or the base

        with pytest.raises(ModelNotFound) as missing:
            table.checkout(a)
        with await controller.checkout_on_demand(a, 2, missing.value) as hold:  # b v2 makes room
            assert hold.route.version == 2 and hold.route.adapter == f"{a}-v2-a1"  # a fresh name
            (out,) = await engine.complete([5, 6, 7], Sampling(max_tokens=2, temperature=0),
                                           adapter=hold.route.adapter)
            assert out.token_ids
        assert f"{b}-v2" not in await engine.loaded_adapters() and table.evicted(b) == [2]

        holds = [table.checkout(model) for model in (a, f"{b}@v1", c)]  # every slot in flight
        announce(events, store, publish(store, registry, tiny_model, d, 1))
        with pytest.raises(ModelNotFound) as missing:
            table.checkout(b)
        with pytest.raises(Overloaded) as busy:
            await controller.checkout_on_demand(b, 2, missing.value)
        assert busy.value.reason == "adapter_slots" and "TANDEM_ENGINE__MAX_LOADED_ADAPTERS" in str(busy.value)
        assert sorted(await engine.loaded_adapters()) == sorted([f"{a}-v2-a1", f"{b}-v1", f"{c}-v1"])
        for hold in holds:
            hold.release()
        await wait_until(lambda: table.serving(d) == 1, what="d v1 serving once a slot is free")
        with await controller.checkout_on_demand(b, 2, missing.value) as hold:
            assert hold.route.version == 2
        assert not events_of(events, EventKind.ADAPTER_REJECTED, d)  # waiting for a slot refuses nothing


async def test_a_load_that_finds_every_slot_in_flight_drains_the_least_recently_used_one(
    redis_conn: redis.Redis, settings: InferenceSettings, store: AdapterStore, tiny_model: Path
) -> None:
    """More busy runs than slots: no adapter goes idle on its own, so a new version's load takes the
    least recently used adapter out of routing while its request goes on, and loads as soon as that
    request ends, with the other slots still serving theirs (tandem_inference.controller.slots)."""
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    async with three_slot_controller(redis_conn, settings, store, tiny_model, "busy") as (controller, engine, (a, b, c, d)):
        table = controller.table
        for run in (a, b, c):
            announce(events, store, publish(store, registry, tiny_model, run, 1))
            await wait_until(lambda r=run: table.serving(r) == 1, what=f"{run} v1")
        held = {run: table.checkout(run) for run in (a, b, c)}  # a's is the least recent use
        announce(events, store, publish(store, registry, tiny_model, d, 1))
        await wait_until(lambda: table.evicted(a) == [1], what="a v1 drained for d v1")
        with pytest.raises(ModelNotFound):  # a new request for `a` loads it again on demand
            table.checkout(a)
        assert f"{a}-v1" in await engine.loaded_adapters()  # its request still uses it
        assert table.serving(d) == 0
        held.pop(a).release()
        await wait_until(lambda: table.serving(d) == 1, what="d v1 serving once a's request ended")
        assert sorted(await engine.loaded_adapters()) == sorted([f"{b}-v1", f"{c}-v1", f"{d}-v1"])
        assert all(table.adapter(run, 1) == f"{run}-v1" for run in (b, c))  # their requests untouched
        for hold in held.values():
            hold.release()
        assert not events_of(events, EventKind.ADAPTER_REJECTED, d)


async def test_a_run_created_after_start_gets_its_gauges_at_the_next_reconcile(
    start, settings: InferenceSettings, redis_conn: redis.Redis, tiny_model: Path
) -> None:
    """So every replica reports the same runs (`count by (run) (tandem_serving_version)`), at v0
    until a version loads, whether it restarted before or after the run was created."""
    settings.controller.reconcile_s = 0.2
    controller = await start()
    Registry(redis_conn).create_run(RunSpec(name="late-run", base_model=str(tiny_model)))

    def gauges() -> str:
        return generate_latest(controller.metrics.registry).decode()

    await wait_until(lambda: 'tandem_serving_version{run="late-run"} 0.0' in gauges(), timeout_s=10,
                     what="the new run's serving gauge")
    assert 'tandem_loaded_versions{run="late-run"} 0.0' in gauges()


async def test_a_run_deleted_while_its_version_loads_is_taken_back_and_nothing_fails(
    run: str, start, redis_conn: redis.Redis, store: AdapterStore, engine: TransformersEngine, tiny_model: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The run was deleted and its run_deleted handled while the engine loaded its new version: the
    load's end raised (the routing table no longer knew the run), logged as a failed event with its
    traceback, and the adapter stayed in the engine until the next reconcile found it."""
    caplog.set_level(logging.INFO)
    controller = await start()
    registry, events = Registry(redis_conn), EventStream(redis_conn)
    real_load = engine.load_adapter

    async def load(name: str, path: str) -> float:
        load_ms = await real_load(name, path)
        if name.startswith(f"{run}-v1"):
            delete_run(redis_conn, run)  # the gateway's DELETE as the engine's load completes
            controller.forget_run(run)  # and its run_deleted, handled meanwhile
        return load_ms

    engine.load_adapter = load  # type: ignore[method-assign]
    announce(events, store, publish(store, registry, tiny_model, run, 1))
    await wait_until(lambda: "the run was deleted while it loaded" in caplog.text, what="the load given up")
    await wait_until(lambda: _lacks(engine, f"{run}-v1"), what="the adapter taken back")
    assert "failed; skipping it" not in caplog.text and "Traceback" not in caplog.text
    assert not events_of(events, EventKind.ADAPTER_LOADED, run)
