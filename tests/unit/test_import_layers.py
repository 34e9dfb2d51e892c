"""Imports at run time go one way: no module of tandem, tandem_trainer or tandem_inference imports,
as it loads, a module that imports it back, and the service packages import only `tandem`.

A circle among modules that load at import time works only while the order in which they are first
imported happens to suit it; the first import from elsewhere finds a half-initialised module. The
graph is read from the sources (nothing is imported, so torch and fastapi need not be there): every
import a module runs as it loads, in its body, a class body, or under `if`, `try` or `with`, but
not inside a function (deferred on purpose) and not under `if TYPE_CHECKING:` (never run).
Importing a module runs its packages' `__init__` first, so an import counts for the module and
its packages, except the packages of the importing module itself: those are loading already, and
`from tandem import keys` in `tandem.events` imports the submodule without running `tandem/__init__`
again. `from package import name`, where `name` is not a module, needs the package's `__init__`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "tandem": ROOT / "shared" / "src" / "tandem",
    "tandem_trainer": ROOT / "trainer" / "src" / "tandem_trainer",
    "tandem_inference": ROOT / "inference" / "src" / "tandem_inference",
}
#: The packages each package may import at run time, itself aside.
LAYERS = {"tandem": set(), "tandem_trainer": {"tandem"}, "tandem_inference": {"tandem"}}


def modules(sources: dict[str, Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, directory in sources.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [package, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


#: One import: a module, and the name taken from it (`from module import name`) or None.
Import = tuple[str, str | None]


def run_time_imports(statements: list[ast.stmt], name: str, is_package: bool) -> set[Import]:
    """What `statements` import when they run as module `name` loads."""
    imported: set[Import] = set()
    for node in statements:
        if isinstance(node, ast.Import):
            imported |= {(alias.name, None) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the importing module's package, or a package above it
                package = name.split(".")[: name.count(".") + 1 - node.level + is_package]
                module = ".".join([*package, *([module] if module else [])])
            imported |= {(module, alias.name) for alias in node.names}
        elif isinstance(node, ast.If):
            if not is_type_checking(node.test):
                imported |= run_time_imports(node.body, name, is_package)
            imported |= run_time_imports(node.orelse, name, is_package)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                imported |= run_time_imports(block, name, is_package)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            imported |= run_time_imports(node.body, name, is_package)
    return imported


def import_graph(sources: dict[str, Path] = SOURCES) -> dict[str, set[str]]:
    """Each module and the modules of `sources` that run before it can finish loading."""
    found = modules(sources)
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        is_package = path.name == "__init__.py"
        imported = run_time_imports(ast.parse(path.read_text(), filename=str(path)).body, name, is_package)
        parts = name.split(".")
        loading = {".".join(parts[:i]) for i in range(1, len(parts) + is_package)}
        targets: set[str] = set()
        for module, attribute in imported:
            submodule = f"{module}.{attribute}"
            target = submodule if attribute and submodule in found else module
            steps = target.split(".")
            targets |= {".".join(steps[:i]) for i in range(1, len(steps) + 1)} - loading
            if attribute and target == module:  # a name the package's `__init__` defines
                targets.add(module)
        graph[name] = (targets & found.keys()) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_graph_is_read_at_run_time_only() -> None:
    graph = import_graph()
    assert {"tandem.client", "tandem_trainer.jobs.runner", "tandem_inference.gateway.app"} <= graph.keys()
    # a module-level import, and one in a package's `__init__`
    assert "tandem.session" in graph["tandem.client"]
    assert "tandem.settings.root" in graph["tandem.settings"]
    # across packages; a thin entry point's deferred imports are not counted
    assert "tandem.settings" in graph["tandem_trainer.worker"]
    assert "tandem_trainer.worker" not in graph["tandem_trainer.main"]


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_type_checking_and_deferred_imports_are_not_run_time() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import tandem.keys\n"
        "if TYPE_CHECKING:\n    import tandem.client\nelse:\n    import tandem.events\n"
        "try:\n    from tandem import registry\nexcept ImportError:\n    pass\n"
        "class A:\n    from tandem.settings import root\n"
        "def f():\n    import tandem.jobs\n"
    )
    imported = run_time_imports(ast.parse(source).body, "tandem.x", False)
    assert imported == {
        ("typing", "TYPE_CHECKING"), ("tandem.keys", None), ("tandem.events", None),
        ("tandem", "registry"), ("tandem.settings", "root"),
    }
    relative = "from . import keys\nfrom .settings import root\n"
    assert run_time_imports(ast.parse(relative).body, "tandem", True) == {("tandem", "keys"), ("tandem.settings", "root")}
    assert run_time_imports(ast.parse(relative).body, "tandem.x", False) == {("tandem", "keys"), ("tandem.settings", "root")}


def test_a_package_counts_where_its_init_runs(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "keys.py").write_text("")
    (package / "a.py").write_text("from pkg import keys\nclass A: ...\n")
    graph = import_graph({"pkg": package})
    assert graph["pkg.a"] == {"pkg.keys"} and circles(graph) == []
    (package / "a.py").write_text("from pkg import keys\nfrom pkg.b import B\nclass A: ...\n")
    (package / "b.py").write_text("from pkg import A\nclass B: ...\n")
    assert circles(import_graph({"pkg": package})) == [["pkg", "pkg.a", "pkg.b"]]


def test_no_import_circle_at_run_time() -> None:
    assert circles(import_graph()) == []


def test_the_services_import_only_the_light_package() -> None:
    graph = import_graph()
    crossing = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if (package := target.split(".")[0]) != name.split(".")[0] and package not in LAYERS[name.split(".")[0]]
    )
    assert crossing == []
