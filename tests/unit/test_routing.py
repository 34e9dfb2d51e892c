"""The routing table: model resolution, pinned versions, unknown names, in-flight counting."""

from __future__ import annotations

import pytest

from tandem.runs import adapter_name, parse_adapter_name
from tandem_inference.controller.service import no_such_version
from tandem_inference.errors import ModelNotFound
from tandem_inference.routing import Route, RoutingTable, parse_model


@pytest.fixture
def table() -> RoutingTable:
    t = RoutingTable("base")
    t.add_run("digits")
    t.add_run("fresh")
    t.add_version("digits", 1)
    t.add_version("digits", 2)
    return t


def test_parse_model() -> None:
    assert parse_model("digits") == ("digits", None)
    assert parse_model("digits@v7") == ("digits", 7)
    assert parse_model("digits@7") == ("digits", 7)
    assert parse_model("my-run.v2@v10") == ("my-run.v2", 10)
    assert parse_model("digits@v7\n") == ("digits@v7\n", None)  # no pin: refused as an unknown model
    # versions are ASCII digits without leading zeros (int() reads "٣" and "７" as 3 and 7)
    for loose in ("digits@v\u0663", "digits@\uff17", "digits@v007", "digits@v" + "9" * 40):
        assert parse_model(loose) == (loose, None), loose


def test_base_model_and_runs_resolve(table: RoutingTable) -> None:
    assert table.resolve("base") == Route(None, 0)
    assert table.resolve("base").adapter is None
    assert table.resolve("digits") == Route("digits", 2)
    assert table.resolve("digits").adapter == "digits-v2"
    fresh = table.resolve("fresh")  # known run, nothing trained yet: the base model
    assert fresh == Route("fresh", 0) and fresh.adapter is None
    assert fresh.name("base") == "fresh@v0" and Route(None, 0).name("base") == "base"


def test_pinned_versions(table: RoutingTable) -> None:
    assert table.resolve("digits@v1") == Route("digits", 1)
    assert table.resolve("digits@1").adapter == "digits-v1"
    assert table.resolve("digits@v0") == Route("digits", 0)
    with pytest.raises(ModelNotFound) as info:
        table.resolve("digits@v5")
    assert info.value.known == ["digits@v0", "digits@v1", "digits@v2"]
    assert "digits@v1" in str(info.value) and "5" in str(info.value)


def test_unknown_run_lists_known_ones(table: RoutingTable) -> None:
    with pytest.raises(ModelNotFound) as info:
        table.resolve("nope")
    assert info.value.known == ["base", "digits", "fresh"]
    assert "'nope'" in str(info.value)
    with pytest.raises(ModelNotFound):
        table.resolve("nope@v1")


def test_alias_moves_only_when_a_version_is_added(table: RoutingTable) -> None:
    assert table.serving("digits") == 2
    table.add_version("digits", 3)  # the controller calls this after the engine confirmed the load
    assert table.serving("digits") == 3 and table.resolve("digits").version == 3
    assert table.known_models() == ["base", "digits", "digits@v1", "digits@v2", "digits@v3", "fresh"]
    with pytest.raises(ValueError):
        table.add_version("digits", 0)


def test_retired_versions_are_never_routed(table: RoutingTable) -> None:
    assert table.retire("digits", 1) == 0
    assert table.loaded("digits") == [2]
    with pytest.raises(ModelNotFound):
        table.resolve("digits@v1")
    table.retire("digits", 2)
    assert table.resolve("digits") == Route("digits", 0)  # back to the base model, never an unloaded version


def test_in_flight_counting(table: RoutingTable) -> None:
    a = table.checkout("digits")
    b = table.checkout("digits@v2")
    c = table.checkout("digits@v1")
    assert a.route == b.route == Route("digits", 2)
    assert table.in_flight("digits", 2) == 2 and table.in_flight("digits", 1) == 1
    assert table.in_flight_total() == 3
    assert table.snapshot()["digits"]["in_flight"] == {"1": 1, "2": 2}
    # retiring a busy version reports its count; it stays counted until released
    assert table.retire("digits", 1) == 1
    c.release()
    c.release()  # twice is harmless
    assert table.in_flight("digits", 1) == 0
    with a:
        pass
    assert table.in_flight("digits", 2) == 1
    b.release()
    assert table.in_flight_total() == 0


def test_failed_checkout_counts_nothing(table: RoutingTable) -> None:
    with pytest.raises(ModelNotFound):
        table.checkout("digits@v9")
    assert table.in_flight_total() == 0


def test_invalid_run_name_is_refused(table: RoutingTable) -> None:
    for name in ("bad@name", "bad\n"):
        with pytest.raises(ValueError):
            table.add_run(name)


def test_each_version_keeps_the_adapter_name_it_was_loaded_under(table: RoutingTable) -> None:
    table.add_version("digits", 3, "digits-v3-a1")  # a second attempt: the first name is never reused
    assert table.resolve("digits").adapter == "digits-v3-a1"
    assert table.resolve("digits@v3") == Route("digits", 3)  # routes compare by run and version
    assert table.adapter("digits", 3) == "digits-v3-a1" and table.adapter("digits", 1) == "digits-v1"
    assert table.adapter("digits", 9) is None
    with table.checkout("digits") as lease:
        assert lease.route.adapter == "digits-v3-a1" and table.in_flight("digits", 3) == 1


def test_only_known_runs_take_versions(table: RoutingTable) -> None:
    with pytest.raises(ValueError, match="unknown run 'ghost'"):
        table.add_version("ghost", 1)
    assert "ghost" not in table.runs()


@pytest.mark.parametrize(("run", "version", "attempt"), [("r", 2, 0), ("r", 2, 1), ("a-v1", 2, 0), ("r-v2-a1", 1, 3)])
def test_adapter_names_round_trip_and_hold_no_colon_or_dot(run: str, version: int, attempt: int) -> None:
    name = adapter_name(run, version, attempt)
    assert ":" not in name and "." not in name
    assert parse_adapter_name(name) == (run, version, attempt)
    assert len({adapter_name(run, version, a) for a in range(5)}) == 5  # every attempt has its own name


def test_foreign_adapter_names_do_not_parse() -> None:
    assert parse_adapter_name("tuned") is None and parse_adapter_name("../x-v1") is None


def test_a_dropped_run_resolves_no_more_and_its_requests_in_flight_keep_counting(table: RoutingTable) -> None:
    hold = table.checkout("digits")
    assert table.drop_run("digits") == {1: "digits-v1", 2: "digits-v2"}
    for model in ("digits", "digits@v2", "digits@v0"):
        with pytest.raises(ModelNotFound, match="no run 'digits'"):
            table.resolve(model)
    assert table.runs() == ["fresh"] and "digits" not in table.snapshot()
    assert table.in_flight("digits", 2) == 1  # the unloader waits for it
    hold.release()
    assert table.in_flight("digits", 2) == 0 and table.drop_run("digits") == {}
    table.add_run("digits")  # created again: a new run, from version 0
    assert table.resolve("digits") == Route("digits", 0)


@pytest.mark.parametrize(
    ("registered", "says", "known"),
    [
        ([], "it has no versions yet (only the base model, v0)", ["r@v0"]),
        ([3, 4, 9], "its versions are v3, v4, v9", ["r@v0", "r@v3", "r@v4", "r@v9"]),
        (list(range(1, 31)), "it has 30 versions, v1 to v30", ["r@v0", *(f"r@v{v}" for v in range(11, 31))]),
    ],
)
def test_a_missing_version_names_the_registered_ones_not_only_the_loaded(
    registered: list[int], says: str, known: list[str]
) -> None:
    """Older versions load on request, so the 404 for one the registry lacks lists what it has."""
    exc = no_such_version("r", 99, registered)
    assert isinstance(exc, ModelNotFound)
    assert str(exc).startswith(f"run 'r' has no version 99: {says} ")
    assert exc.known == known
