"""The e2e tier's module-scoped `stack` fixture: the CPU container stack, built and started once.

It builds the images (docker caches the layers; dependencies come before the source), writes
an `.env` into a temporary directory (passed with --env-file, so a developer's own `.env` is
never touched), starts the stack under its own project name, waits until every service is
healthy and the published gateway is ready, and always tears it down with `down -v`. When a
test of the module failed, or the stack did not come up, every service's logs are printed;
they are written to `.tandem/e2e/<project>.log` every time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from compose_stack import ComposeStack, started_stack


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    yield from started_stack(request, tmp_path_factory)
