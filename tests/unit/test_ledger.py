"""The ledger of the engine's adapters: the last list read, with the controller's own loads and
unloads since; unknown after a call of unknown outcome, or for a list that may predate a change."""

from __future__ import annotations

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
