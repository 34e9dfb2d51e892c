"""Room for a load from the engine's list as the loader saw it beside its checks.

The loader asks the engine for its adapters while it checks the files, and hands that list to
`Slots.make_room`: with room in it, the engine is not asked again (the `room` stage is off the
path); a full list is not trusted (a slot may have come free since): the engine is asked again
before the least recently used idle adapter is evicted, and after. The engine here is a dict behind the methods
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


def test_a_full_list_is_asked_for_afresh_before_the_least_recently_used_is_evicted() -> None:
    engine = ListedEngine(["a-v1", "b-v1"])
    room = slots(engine, table_of(("a", 1), ("b", 1)), limit=2)
    touched = asyncio.run(room.make_room("c-v1", seen=dict(engine.held)))
    assert touched == {"a"} and engine.unloaded == ["a-v1"]
    assert engine.asked == 2  # before the eviction and after it: never the old list's count


def test_a_slot_that_came_free_since_the_list_costs_no_eviction() -> None:
    engine = ListedEngine(["a-v1", "b-v1"])
    seen = dict(engine.held)  # full when the loader looked
    del engine.held["b-v1"]  # unloaded since (a retired version, outside the load)
    room = slots(engine, table_of(("a", 1), ("b", 1)), limit=2)
    assert asyncio.run(room.make_room("c-v1", seen=seen)) == set()
    assert engine.unloaded == [] and engine.asked == 1


def test_a_run_at_its_quota_in_the_list_evicts_its_own_counted_afresh() -> None:
    engine = ListedEngine(["a-v1", "a-v2", "b-v1"])
    room = slots(engine, table_of(("b", 1), ("a", 1), ("a", 2)), limit=4, run_limit=2)
    touched = asyncio.run(room.make_room("a-v3", seen=dict(engine.held)))
    assert touched == {"a"} and engine.unloaded == ["a-v1"]  # its own oldest, not b's older one
    assert engine.asked == 3  # the run's count before and after its eviction, then the engine's slots
