"""The engine's adapters as the controller knows them between its looks at the engine's list."""

from __future__ import annotations

from collections.abc import Mapping


class Ledger:
    """The engine's adapters as the controller knows them between its looks at the engine's list:
    the last list it read, with its own loads and unloads since applied to it. Every load and
    unload goes through the controller, so between looks that is what the engine holds -- but
    after a call whose outcome it could not see (a load or unload that failed or timed out may
    still complete in the engine), after an engine restart, and for a list read while a load or
    unload completed (the list may predate it), the ledger is unknown until the next list: the
    reconcile reads one every `controller.reconcile_s`, a load that finds it unknown reads one.

    A load that finds room in it goes ahead without asking the engine first (the list is a round
    trip through the engine's HTTP server and the controller's event loop, on the path to serving);
    a ledger that shows no room is not trusted, and the engine is asked (Slots.make_room)."""

    def __init__(self) -> None:
        self._names: dict[str, str] | None = None
        self._changes = 0

    @property
    def names(self) -> dict[str, str] | None:
        """The engine's adapters (name -> path), or None when not known."""
        return dict(self._names) if self._names is not None else None

    def asking(self) -> int:
        """Call before asking the engine for its list; give the result to `seen` with the list."""
        return self._changes

    def seen(self, names: Mapping[str, str], asked: int) -> None:
        """The engine's list, asked for when `asking` returned `asked`."""
        self._names = dict(names) if asked == self._changes else None

    def loaded(self, name: str, path: str) -> None:
        self._changes += 1
        if self._names is not None:
            self._names[name] = path

    def unloaded(self, name: str) -> None:
        self._changes += 1
        if self._names is not None:
            self._names.pop(name, None)

    def lost(self) -> None:
        """A load or unload whose outcome is not known, or an engine that restarted."""
        self._changes += 1
        self._names = None
