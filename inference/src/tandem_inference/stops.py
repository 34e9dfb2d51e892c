"""Stop strings in streamed text: how much of a running text can be sent before the end.

An engine matches stop strings on decoded text, and a stop string may span several tokens:
while its first tokens arrive, the text ends with what may be the start of it, and the final
text is cut where the stop string begins. A stream must therefore hold back every suffix that
could still begin a stop string (and a half-decoded character, U+FFFD) until the engine
decides, so that the streamed deltas add up to exactly the text of the same request unstreamed.
"""

from __future__ import annotations

from collections.abc import Sequence


def sendable(text: str, stops: Sequence[str]) -> str:
    """The longest prefix of a running `text` that every continuation of it keeps.

    Stops at the first whole stop string in `text`, before a trailing U+FFFD (half a character
    still being decoded), and before the earliest suffix that is the beginning of a stop string.
    """
    end = len(text.rstrip("\ufffd"))
    cut = end
    for stop in stops:
        if not stop:
            continue
        found = text.find(stop, 0, end)
        if found != -1:
            cut = min(cut, found)
        for start in range(max(0, end - len(stop) + 1), end):
            if stop.startswith(text[start:end]):
                cut = min(cut, start)
                break
    return text[:cut]


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop string in `text` begins, and which one it is; None if none is there.

    Of stop strings that begin at the same place, the first in sort order.
    """
    found = [(at, stop) for stop in stops if stop and (at := text.find(stop)) != -1]
    return min(found) if found else None


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first place where any stop string begins (all of it if none does)."""
    hit = first_stop(text, stops)
    return text if hit is None else text[: hit[0]]
