"""The light package never imports torch, fastapi or the service packages."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import tandem


def test_every_tandem_module_imports_without_heavy_dependencies() -> None:
    modules = [m.name for m in pkgutil.walk_packages(tandem.__path__, "tandem.")]
    assert "tandem.client" in modules and "tandem.settings" in modules and "tandem.dev.stack" in modules
    code = (
        "import sys\n"
        "for banned in ('torch', 'transformers', 'fastapi', 'peft', 'tandem_trainer', 'tandem_inference'):\n"
        "    sys.modules[banned] = None\n"
        f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_no_tandem_module_imports_one_that_imports_it_back() -> None:
    """Imports go one way, type-only ones included: episodes and handles know their run as a
    `session.SessionRun`, not through client.py, which imports them."""
    root = Path(tandem.__file__).parent
    names = {m.name for m in pkgutil.walk_packages(tandem.__path__, "tandem.")}
    graph: dict[str, set[str]] = {}
    for name in names:
        path = root.joinpath(*name.split(".")[1:])
        source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
        imported: set[str] = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = (imported & names) - {name}

    def reached(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for module in graph[todo.pop()] - seen:
                seen.add(module)
                todo.append(module)
        return seen

    assert "tandem.client" in graph and [name for name in sorted(graph) if name in reached(name)] == []
