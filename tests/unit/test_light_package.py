"""The light package never imports torch, fastapi or the service packages."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

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
