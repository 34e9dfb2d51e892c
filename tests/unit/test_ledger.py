"""The ledger of the engine's adapters: the last list read, with the controller's own loads and
unloads since; unknown after a call of unknown outcome, or for a list that may predate a change."""

from __future__ import annotations

import asyncio

import pytest

from tandem_inference.controller.ledger import Ledger


def test_unknown_until_a_list_is_read_then_kept_by_loads_and_unloads() -> None:
    ledger = Ledger()
    ledger.loaded("a-v1", "/store/a/v1")  # before any list: still unknown
    assert ledger.names is None
    asked = ledger.asking()
    ledger.seen({"a-v1": "/store/a/v1"}, asked)
    ledger.loaded("a-v2", "/store/a/v2")
    ledger.unloaded("a-v1")
    ledger.unloaded("never-held")
    assert ledger.names == {"a-v2": "/store/a/v2"}


def test_a_list_asked_for_before_a_load_or_unload_completed_is_not_taken() -> None:
    for change in (lambda ledger: ledger.loaded("b-v1", "/b"), lambda ledger: ledger.unloaded("a-v1")):
        ledger = Ledger()
        asked = ledger.asking()
        change(ledger)  # completed while the list was on its way: the list may predate it
        ledger.seen({"a-v1": "/a"}, asked)
        assert ledger.names is None
        ledger.seen({"a-v1": "/a"}, ledger.asking())  # a list asked for afterwards is
        assert ledger.names == {"a-v1": "/a"}


def test_a_call_of_unknown_outcome_forgets_the_ledger() -> None:
    ledger = Ledger()
    ledger.seen({"a-v1": "/a"}, ledger.asking())
    ledger.lost()
    assert ledger.names is None
    ledger.loaded("a-v2", "/a2")  # kept only from the next list on
    assert ledger.names is None


def test_the_names_given_out_are_a_copy() -> None:
    ledger = Ledger()
    ledger.seen({"a-v1": "/a"}, ledger.asking())
    names = ledger.names
    assert names is not None
    names["x"] = "/x"
    assert ledger.names == {"a-v1": "/a"}


class Engine:
    """The engine's adapter calls (a unit test's network edge): a dict, or an error for each call."""

    def __init__(self, held: dict[str, str], error: Exception | None = None) -> None:
        self.held, self.error = held, error

    async def loaded_adapters(self) -> dict[str, str]:
        return dict(self.held)

    async def load_adapter(self, name: str, path: str) -> float:
        if self.error is not None:
            raise self.error
        self.held[name] = path
        return 1.0

    async def unload_adapter(self, name: str) -> None:
        if self.error is not None:
            raise self.error
        del self.held[name]


def test_the_engine_calls_through_the_ledger_keep_it_or_forget_it() -> None:
    engine, ledger = Engine({"a-v1": "/a"}), Ledger()
    assert asyncio.run(ledger.look(engine)) == {"a-v1": "/a"} == ledger.names  # type: ignore[arg-type]
    asyncio.run(ledger.load(engine, "a-v2", "/a2"))  # type: ignore[arg-type]
    asyncio.run(ledger.unload(engine, "a-v1"))  # type: ignore[arg-type]
    assert ledger.names == engine.held == {"a-v2": "/a2"}
    engine.error = TimeoutError("the engine did not answer")  # it may still complete the call
    for call in (ledger.load(engine, "a-v3", "/a3"), ledger.unload(engine, "a-v2")):  # type: ignore[arg-type]
        asyncio.run(ledger.look(engine))  # type: ignore[arg-type]
        with pytest.raises(TimeoutError):
            asyncio.run(call)
        assert ledger.names is None
