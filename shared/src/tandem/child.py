"""Child processes that die with the process that starts them (Linux).

`guarded(argv)` runs `argv` through a small guard, in the child's own process: it asks the kernel
to SIGKILL the child when the thread that started it ends (its parent crashed or was killed,
SIGKILL included), checks that this thread is still there (it may have died before the request
took effect), then execs `argv`, which keeps the request (it survives exec). So a supervisor
killed outright leaves no service running on in its place, holding ports and its state
directory's files. The request is tied to the starting thread, not the process: start guarded
children from a thread that lives as long as they should.
"""

from __future__ import annotations

import os
import sys

_GUARD = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:\n"  # PR_SET_PDEATHSIG
    "    sys.exit(f'child guard: prctl failed (errno {ctypes.get_errno()})')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('child guard: the process that started this one is gone')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def guarded(argv: list[str]) -> list[str]:
    """`argv` run through the guard, so that it dies with the process (thread) that starts it."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _GUARD, str(os.getpid()), *argv]
