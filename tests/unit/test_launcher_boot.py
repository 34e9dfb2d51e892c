"""The SGLang launcher's boot refusals that need no engine: each is an EngineBootError naming what to fix."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from helpers.loopback import free_port

from tandem.settings import EngineSettings, InferenceSettings
from tandem_inference.engines.launcher import Launcher
from tandem_inference.errors import EngineBootError, InferenceError


async def test_a_log_file_that_cannot_be_written_is_a_boot_error_naming_it(tmp_path: Path) -> None:
    """An OS error while starting the engine (here: its log directory is under a file) is an
    EngineBootError naming the path, which the service reports in one line, not a traceback."""
    blocker = tmp_path / "store-parent"
    blocker.write_text("a file where the log directory should be")
    settings = InferenceSettings(engine=EngineSettings(kind="sglang", url=f"http://127.0.0.1:{free_port()}"))
    async with httpx.AsyncClient() as http:
        launcher = Launcher(settings, http, argv=["true"], env={}, log_path=blocker / "logs" / "sglang.log")
        with pytest.raises(EngineBootError, match=r"store-parent/logs/sglang\.log") as info:
            await launcher.start()
    assert isinstance(info.value, InferenceError)
    assert launcher.proc is None  # nothing was started
