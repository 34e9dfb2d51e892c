"""Room for a load from the engine's list as the loader saw it beside its checks.

The loader asks the engine for its adapters while it checks the files, and hands that list to
`Slots.make_room`: with room in it, the engine is not asked again (the `room` stage is off the
path); without, the least recently used idle adapter is evicted and the engine is asked again,
never trusting a list from before the eviction. The engine here is a dict behind the methods
Slots calls (a unit test's network edge).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from tandem_inference.controller.slots import Slots
from tandem_inference.controller.unloading import Unloader
from tandem_inference.routing import RoutingTable


class ListedEngine:
    """The engine's adapters, and how often Slots asked for them."""

    def __init__(self, names: list[str]) -> None:
        self.held = {name: f"/store/{name}" for name in names}
        self.asked = 0
        self.unloaded: list[str] = []

    async def loaded_adapters(self) -> dict[str, str]:
        self.asked += 1
        return dict(self.held)

    async def unload_adapter(self, name: str) -> None:
        self.unloaded.append(name)
        del self.held[name]


def slots(engine: ListedEngine, table: RoutingTable, *, limit: int, run_limit: int | None = None) -> Slots:
    registry = CollectorRegistry()
    unloader = Unloader(engine, table, Counter("unloads", "", ["run", "outcome"], registry=registry))  # type: ignore[arg-type]
    return Slots(engine, table, unloader, limit=limit, wait_s=0.5,  # type: ignore[arg-type]
                 evictions=Counter("evictions", "", ["run"], registry=registry), run_limit=run_limit)


def table_of(*loaded: tuple[str, int]) -> RoutingTable:
    table = RoutingTable("base")
    for run, version in loaded:
        if not table.has_run(run):
            table.add_run(run)
        table.add_version(run, version, f"{run}-v{version}")
    return table


def test_a_list_with_room_is_enough_the_engine_is_not_asked_again() -> None:
    engine = ListedEngine(["a-v1", "b-v1"])
    room = slots(engine, table_of(("a", 1), ("b", 1)), limit=3, run_limit=2)
    touched = asyncio.run(room.make_room("a-v2", seen=dict(engine.held)))
    assert touched == set() and engine.asked == 0 and engine.unloaded == []


def test_without_a_list_the_engine_is_asked() -> None:
    engine = ListedEngine(["a-v1"])
    room = slots(engine, table_of(("a", 1)), limit=3)
    assert asyncio.run(room.make_room("b-v1")) == set()
    assert engine.asked == 1


def test_a_full_list_evicts_the_least_recently_used_and_asks_the_engine_again() -> None:
    engine = ListedEngine(["a-v1", "b-v1"])
    room = slots(engine, table_of(("a", 1), ("b", 1)), limit=2)
    touched = asyncio.run(room.make_room("c-v1", seen=dict(engine.held)))
    assert touched == {"a"} and engine.unloaded == ["a-v1"]
    assert engine.asked == 1  # after the eviction the count is the engine's own, not the old list's


def test_a_run_at_its_quota_in_the_list_evicts_its_own_and_then_counts_the_engine_afresh() -> None:
    engine = ListedEngine(["a-v1", "a-v2", "b-v1"])
    room = slots(engine, table_of(("b", 1), ("a", 1), ("a", 2)), limit=4, run_limit=2)
    touched = asyncio.run(room.make_room("a-v3", seen=dict(engine.held)))
    assert touched == {"a"} and engine.unloaded == ["a-v1"]  # its own oldest, not b's older one
    assert engine.asked == 2  # the run's count after its eviction, then the engine's slots
