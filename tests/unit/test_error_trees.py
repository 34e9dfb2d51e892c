"""One error tree per package: every exception class a package defines sits under its root,
lives in (or is re-exported from) its `errors.py`, and is drawn in that module's docstring.

Every module of each package is imported (the services' torch imports included), so a class
defined anywhere, not only in errors.py, is found.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

#: package -> name of its root error (in the package's errors.py)
ROOTS = {"tandem": "TandemError", "tandem_trainer": "TrainerError", "tandem_inference": "InferenceError"}


def _in_package(module_name: str, package: str) -> bool:
    return module_name == package or module_name.startswith(f"{package}.")


def _modules(package: str) -> list[ModuleType]:
    """Every module of `package`; a module that needs an optional dependency not installed here
    (a GPU-only library) is skipped, any other import failure fails the test."""
    root = importlib.import_module(package)
    modules = [root]
    for info in pkgutil.walk_packages(root.__path__, f"{package}.", onerror=lambda name: None):
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing.split(".")[0] in ROOTS:
                raise
    return modules


def _defined_errors(package: str) -> dict[str, type[BaseException]]:
    """Qualified name -> exception class, for every class defined in the package."""
    found: dict[str, type[BaseException]] = {}
    for module in _modules(package):
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and _in_package(obj.__module__, package):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


@pytest.mark.parametrize("package", ROOTS)
def test_every_exception_a_package_defines_is_in_its_tree(package: str) -> None:
    errors = importlib.import_module(f"{package}.errors")
    root = vars(errors)[ROOTS[package]]
    tree = errors.__doc__ or ""
    problems = []
    for name, cls in sorted(_defined_errors(package).items()):
        if not issubclass(cls, root):
            problems.append(f"{name} is not a {root.__name__}")
        if vars(errors).get(cls.__name__) is not cls:
            problems.append(f"{name} is neither defined in nor re-exported from {errors.__name__}")
        if not re.search(rf"\b{re.escape(cls.__name__)}\b", tree):
            problems.append(f"{name} is not drawn in the docstring tree of {errors.__name__}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", ROOTS)
def test_the_tree_finds_the_packages_errors(package: str) -> None:
    """The walk sees errors.py itself, so a tree that found nothing would not pass unnoticed."""
    assert f"{package}.errors.{ROOTS[package]}" in _defined_errors(package)
