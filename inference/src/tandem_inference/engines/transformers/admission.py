"""Which requests may start, and waiting for the running ones: the engine's admission.

Every generation runs inside `in_flight(adapter)` (None = the base model): it is admitted only
while that adapter is registered and the engine's memory is not released, and it counts as
running until it ends. Unloading an adapter unregisters it at once (new requests naming it are
refused, as SGLang does) and then waits until its requests are gone; releasing memory refuses
every new request and waits until none is running. One condition variable guards it all.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from tandem_inference.errors import AdapterLoadFailed, AdapterNotLoaded, EngineBusy, EngineUnavailable

NOT_LOADED = "Got LoRA adapter that has never been loaded"  # SGLang's wording, which its client matches (sglang.py)
RELEASED = "engine memory is released; POST /resume_memory_occupation first"


class Admission:
    """The adapters requests may name, the requests running on each, and the released flag."""

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters
        self._cond = threading.Condition()
        self._adapters: dict[str, str] = {}  # name -> path, what requests may use
        self._unloading: set[str] = set()
        self._running: Counter[str | None] = Counter()
        self._released = False

    @property
    def adapters(self) -> dict[str, str]:
        """Registered adapters, name -> path."""
        with self._cond:
            return dict(self._adapters)

    @property
    def released(self) -> bool:
        return self._released

    def check_adapter(self, name: str | None) -> None:
        """Raise AdapterNotLoaded (in SGLang's words) unless `name` is None or registered."""
        loaded = self.adapters
        if name is not None and name not in loaded:
            raise AdapterNotLoaded(f"{NOT_LOADED}: {name!r}; loaded adapters: {sorted(loaded)}")

    def check_released(self) -> None:
        if self._released:
            raise EngineUnavailable(RELEASED)

    @contextmanager
    def in_flight(self, adapter: str | None) -> Iterator[None]:
        """Count one request running on `adapter` (None = base): unload and release wait for it."""
        with self._cond:
            if self._released:
                raise EngineUnavailable(RELEASED)
            if adapter is not None and adapter not in self._adapters:
                raise AdapterNotLoaded(
                    f"{NOT_LOADED}: {adapter!r}; loaded adapters: {sorted(self._adapters)}"
                )
            self._running[adapter] += 1
        try:
            yield
        finally:
            with self._cond:
                self._running[adapter] -= 1
                if self._running[adapter] <= 0:
                    del self._running[adapter]
                self._cond.notify_all()

    # -- adapters -----------------------------------------------------------------------------

    def check_room(self, name: str, prefix: str) -> None:
        """Raise AdapterLoadFailed if `name` is loaded (or unloading) or no slot is free."""
        with self._cond:
            if name in self._adapters or name in self._unloading:
                raise AdapterLoadFailed(f"{prefix} because it is already loaded")
            if len(self._adapters) + len(self._unloading) >= self.max_adapters:
                raise AdapterLoadFailed(
                    f"{prefix}: {self.max_adapters} adapters are loaded already "
                    f"(max_loaded_adapters); unload one first: {sorted(self._adapters)}"
                )

    def register(self, name: str, path: str) -> None:
        """Let requests name `name` from now on."""
        with self._cond:
            self._adapters[name] = path

    @contextmanager
    def unregistered(self, name: str, *, timeout_s: float) -> Iterator[None]:
        """Refuse new requests for `name` at once, wait for its running ones, then run the block.

        Raises AdapterNotLoaded if `name` is not registered, and EngineBusy (re-registering it)
        if its requests still run after `timeout_s`. While the block runs, `name` still takes
        its slot (a load under the same name is refused).
        """
        with self._cond:
            if name not in self._adapters:
                raise AdapterNotLoaded(
                    f"cannot unload LoRA adapter {name!r}: it is not loaded; "
                    f"loaded adapters: {sorted(self._adapters)}"
                )
            path = self._adapters.pop(name)
            self._unloading.add(name)
            if not self._cond.wait_for(lambda: self._running[name] == 0, timeout=timeout_s):
                self._unloading.discard(name)
                self._adapters[name] = path
                raise EngineBusy(
                    f"LoRA adapter {name!r} is still used by {self._running[name]} "
                    f"request(s) after {timeout_s:g}s; it stays loaded, retry later"
                )
        try:
            yield
        finally:
            with self._cond:
                self._unloading.discard(name)

    # -- memory -------------------------------------------------------------------------------

    def refuse_all(self, *, timeout_s: float) -> bool:
        """Refuse new requests and wait until none runs; False if they were refused already.

        Raises EngineBusy (accepting requests again) if some still run after `timeout_s`.
        """
        with self._cond:
            if self._released:
                return False
            self._released = True
            if not self._cond.wait_for(lambda: not self._running, timeout=timeout_s):
                self._released = False
                raise EngineBusy(
                    f"{sum(self._running.values())} request(s) still running after "
                    f"{timeout_s:g}s; memory not released"
                )
        return True

    def accept_all(self) -> None:
        """Admit requests again (after `refuse_all`)."""
        with self._cond:
            self._released = False
