"""Where the admin routes may read from: adapters under engine.adapter_roots, checkpoints under
engine.weights_roots. A path that leads outside them, also through a symlink, is refused."""

from __future__ import annotations

from pathlib import Path

from tandem_inference.errors import EngineError


def confine(path: str, roots: list[Path] | None, field: str, setting: str, error: type[EngineError]) -> None:
    """Refuse `path` (raising `error` naming `field` and `setting`) unless it, and every entry
    in it, resolves inside one of `roots`.

    Symlinks are followed before the check, so none leads out. `roots` None (EngineSettings
    built alone, as tests do) confines nothing; the service's settings always set them.
    """
    if roots is None:
        return
    resolved = [root.resolve() for root in roots]

    def inside(p: Path) -> bool:
        real = p.resolve()
        return any(real.is_relative_to(root) for root in resolved)

    where = f"{[str(r) for r in roots]} ({setting})"
    target = Path(path)
    try:
        if not target.is_absolute() or not inside(target):
            raise error(f"{field} {path!r} is outside the engine's roots {where}; load from inside them")
        if target.is_dir():
            for entry in target.iterdir():
                if not inside(entry):
                    raise error(f"{field} {path!r}: {entry.name} leads outside the engine's roots {where}")
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop, no permission
        raise error(f"{field} {path!r} cannot be checked against the engine's roots {where}: {exc}; "
                    "give a readable path without NUL bytes or symlink loops") from exc
