"""Eviction by recency in the routing table: which loaded version makes room for a load.

The least recently used version (by checkout, or by load when never checked out) that no
request holds goes first; versions in flight and versions held for the replicas' agreement
never go. A run's serving version that was evicted still is what `<run>` means, and resolving
it says it must be loaded again (NotResident), as a pinned version that is not loaded does.
"""

from __future__ import annotations

import pytest

from tandem_inference.errors import ModelNotFound, NotResident
from tandem_inference.routing import Route, RoutingTable


@pytest.fixture
def table() -> RoutingTable:
    t = RoutingTable("base")
    for run in ("a", "b", "c"):
        t.add_run(run)
    t.add_version("a", 1)  # loaded in this order: a v1, b v1, c v1, a v2
    t.add_version("b", 1)
    t.add_version("c", 1)
    t.add_version("a", 2)
    return t


def test_the_least_recently_loaded_goes_first_when_nothing_was_used(table: RoutingTable) -> None:
    assert table.evict_idle() == ("a", 1, "a-v1")
    assert table.evict_idle() == ("b", 1, "b-v1")
    assert table.evict_idle() == ("c", 1, "c-v1")
    assert table.evict_idle() == ("a", 2, "a-v2")
    assert table.evict_idle() is None
    assert table.resident_count() == 0


def test_a_checkout_makes_a_version_the_most_recently_used(table: RoutingTable) -> None:
    table.checkout("a@v1").release()
    table.checkout("b").release()
    assert [table.evict_idle() for _ in range(4)] == [("c", 1, "c-v1"), ("a", 2, "a-v2"), ("a", 1, "a-v1"),
                                                     ("b", 1, "b-v1")]


def test_a_version_in_flight_is_never_evicted_until_released(table: RoutingTable) -> None:
    hold = table.checkout("a@v1")  # the oldest, but in use
    other = table.checkout("c")
    assert table.evict_idle() == ("b", 1, "b-v1")
    assert table.evict_idle() == ("a", 2, "a-v2")
    assert table.evict_idle() is None  # every loaded version serves a request
    assert table.adapter("a", 1) == "a-v1" and table.adapter("c", 1) == "c-v1"
    hold.release()
    assert table.evict_idle() == ("a", 1, "a-v1")
    other.release()
    assert table.evict_idle() == ("c", 1, "c-v1")


def test_keep_spares_named_versions(table: RoutingTable) -> None:
    assert table.evict_idle(keep=frozenset({("a", 1), ("b", 1)})) == ("c", 1, "c-v1")


def test_a_runs_own_eviction_takes_only_its_versions(table: RoutingTable) -> None:
    """What a run over its quota of slots (controller.run_max_loaded_adapters) evicts: its own least
    recently used idle version, never another run's, however older that one is."""
    holds = [table.checkout("a@v1"), table.checkout("a@v2")]
    assert table.evict_idle(run="a") is None  # both of its versions serve requests: b's and c's are not taken
    holds[1].release()
    assert table.evict_idle(run="a") == ("a", 2, "a-v2")  # the only idle one of its own, though b v1 is older
    holds[0].release()
    assert table.evict_idle(run="a") == ("a", 1, "a-v1")
    assert table.evict_idle(run="a") is None
    assert table.loaded("b") == [1] and table.loaded("c") == [1]


def test_a_held_version_newer_than_the_serving_one_is_never_evicted(table: RoutingTable) -> None:
    table.add_version("b", 2, serve=False)  # waits for the replicas to agree
    evicted = [table.evict_idle() for _ in range(5)]
    assert ("b", 2, "b-v2") not in evicted and evicted[-1] is None
    assert table.adapter("b", 2) == "b-v2" and table.held("b") == [2]


def test_an_evicted_serving_version_still_is_what_the_run_means(table: RoutingTable) -> None:
    table.checkout("a@v1").release()  # a v2 (serving) is now the least recently used of run a
    assert table.evict_idle() == ("b", 1, "b-v1")
    assert table.evict_idle() == ("c", 1, "c-v1")
    assert table.evict_idle() == ("a", 2, "a-v2")
    assert table.serving("a") == 2 and table.evicted("a") == [2] and table.loaded("a") == [1]
    with pytest.raises(NotResident) as info:  # not v1, the version still loaded: v2 is loaded again
        table.checkout("a")
    assert (info.value.run, info.value.version) == ("a", 2)
    assert table.in_flight("a", 2) == 0 and table.in_flight_total() == 0  # a refused checkout counts nothing
    table.add_version("a", 2, "a-v2-a1")  # loaded again under a fresh name
    assert table.evicted("a") == [] and table.resolve("a") == Route("a", 2)
    assert table.resolve("a").adapter == "a-v2-a1"


def test_a_pinned_version_that_is_not_loaded_is_not_resident(table: RoutingTable) -> None:
    with pytest.raises(NotResident) as info:
        table.checkout("c@v7")
    assert (info.value.run, info.value.version) == ("c", 7)
    assert isinstance(info.value, ModelNotFound) and "c@v1" in info.value.known  # a 404 where nothing loads it


def test_retiring_or_dropping_forgets_evicted_versions(table: RoutingTable) -> None:
    assert [table.evict_idle() for _ in range(4)][-1] == ("a", 2, "a-v2")
    assert table.evicted("a") == [2] and table.evicted("b") == [1]
    table.retire("a", 2)
    assert table.evicted("a") == [] and table.serving("a") == 0
    table.drop_run("b")
    assert table.evicted("b") == [] and not table.has_run("b")


def test_a_drain_takes_the_least_recently_used_version_even_in_flight(table: RoutingTable) -> None:
    """Every version serves a request: `drain_lru` still takes the least recently used out of routing;
    its requests go on (counted by its adapter), a new request for it finds it not resident."""
    holds = [table.checkout(model) for model in ("a@v1", "b", "c", "a")]
    assert table.evict_idle() is None
    assert table.drain_lru() == ("a", 1, "a-v1")
    assert table.in_flight_adapter("a-v1") == 1  # its request goes on, with its adapter
    with pytest.raises(NotResident):
        table.checkout("a@v1")
    assert table.drain_lru(run="c") == ("c", 1, "c-v1")
    with pytest.raises(NotResident):  # c's serving version was drained: `c` still means v1, to load again
        table.checkout("c")
    assert table.serving("c") == 1 and table.evicted("c") == [1]
    for hold in holds:
        hold.release()
    assert table.in_flight_adapter("a-v1") == 0 and table.in_flight_adapter("c-v1") == 0


def test_a_drain_never_takes_a_held_version(table: RoutingTable) -> None:
    table.add_version("b", 2, serve=False)  # held for the replicas' agreement
    assert table.drain_lru(run="b") == ("b", 1, "b-v1")
    assert table.drain_lru(run="b") is None and table.adapter("b", 2) == "b-v2"


def test_requests_count_by_adapter_so_a_reload_under_a_new_name_is_apart(table: RoutingTable) -> None:
    old = table.checkout("b")
    assert table.drain_lru(run="b") == ("b", 1, "b-v1")
    table.add_version("b", 1, "b-v1-a1")  # loaded again on demand, under a fresh name
    new = table.checkout("b")
    assert (table.in_flight("b", 1), table.in_flight_adapter("b-v1"), table.in_flight_adapter("b-v1-a1")) == (2, 1, 1)
    old.release()
    assert table.in_flight_adapter("b-v1") == 0 and table.in_flight_adapter("b-v1-a1") == 1
    new.release()


def test_evicted_versions_outside_the_keep_window_are_forgotten() -> None:
    """A run whose serving version is evicted at every step (more busy runs than slots) keeps only
    its keep-window of them: older ones are forgotten when the controller retires old versions, and
    a request pinned to one finds it not resident (it loads again), as before."""
    from prometheus_client import CollectorRegistry, Counter

    from tandem_inference.controller.unloading import Unloader

    table = RoutingTable("base")
    table.add_run("a")
    unloads = Counter("unloads", "test", ["run", "outcome"], registry=CollectorRegistry())
    unloader = Unloader(engine=None, table=table, unloads=unloads)  # type: ignore[arg-type]  # retire_old never calls it
    for version in range(1, 51):
        table.add_version("a", version)
        assert table.evict_idle() == ("a", version, f"a-v{version}")
        unloader.retire_old("a", keep=2)
    assert table.evicted("a") == [49, 50] and table.serving("a") == 50
    with pytest.raises(NotResident):
        table.checkout("a@v3")
    with pytest.raises(NotResident):
        table.checkout("a")  # v50, evicted, is still what `a` means
