"""The engine's adapters as the controller knows them between its looks at the engine's list."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem_inference.engines.base import Engine


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
    a ledger that shows no room is not trusted, and the engine is asked (Slots.make_room). The
    controller reaches the engine's adapters through `look`, `load` and `unload`, which keep it."""

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

    async def look(self, engine: Engine) -> dict[str, str]:
        """The engine's adapters (name -> path), asked for now, and taken as the ledger."""
        asked = self.asking()
        names = await engine.loaded_adapters()
        self.seen(names, asked)
        return names

    async def load(self, engine: Engine, name: str, path: str) -> float:
        """The engine's load of `name` from `path` (its ms); any failure (a refusal, a timeout, a
        cancelled call the engine may still complete) leaves the ledger unknown."""
        try:
            load_ms = await engine.load_adapter(name, path)
        except BaseException:
            self.lost()
            raise
        self.loaded(name, path)
        return load_ms

    async def unload(self, engine: Engine, name: str) -> None:
        """The engine's unload of `name`; any failure leaves the ledger unknown."""
        try:
            await engine.unload_adapter(name)
        except BaseException:
            self.lost()
            raise
        self.unloaded(name)

    def lost(self) -> None:
        """A load or unload whose outcome is not known, or an engine that restarted."""
        self._changes += 1
        self._names = None
