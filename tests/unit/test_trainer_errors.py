"""What the trainer raises on purpose is an error of its own tree, under `TrainerError`.

test_error_trees.py checks the classes the trainer defines; this reads every module's source
and checks what it raises: each `raise SomeError(...)` names a class of
`tandem_trainer.errors`, so no builtin or light-package error is raised bare.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tandem_trainer
from tandem.errors import TandemError
from tandem_trainer import errors
from tandem_trainer.errors import TrainerError

pytestmark = pytest.mark.unit

PACKAGE = Path(tandem_trainer.__file__).parent
TREE = {name for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, TrainerError)}
#: Not errors: how an entrypoint ends the process with an exit status.
EXITS = {"SystemExit"}


def _raised(path: Path) -> list[tuple[int, str]]:
    """(line, class name) of each `raise Name(...)` / `raise module.Name(...)` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name is not None:
                found.append((node.lineno, name))
    return found


def test_the_root_sits_under_tandem_error() -> None:
    assert issubclass(TrainerError, TandemError)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_raise_names_a_class_of_the_tree(path: Path) -> None:
    foreign = [f"{path.name}:{line} raises {name}" for line, name in _raised(path)
               if name not in TREE and name not in EXITS]
    assert foreign == []
