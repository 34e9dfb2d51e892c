"""The e2e tier's module-scoped `stack` fixture: the CPU container stack, built and started once
(a module may define its own, as the replicas module does), and a client of it.

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
from compose_stack import MODEL, ComposeStack, started_stack

from tandem import Client
from tandem.dev import toy


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    yield from started_stack(request, tmp_path_factory)


@pytest.fixture(scope="module")
def client(stack: ComposeStack) -> Iterator[Client]:
    c = Client(stack.gateway_url, stack.redis_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def digits(stack: ComposeStack, tmp_path_factory: pytest.TempPathFactory) -> frozenset[int]:
    """Ids of digit tokens, from the tokenizer the stack built into its `models` volume."""
    local = tmp_path_factory.mktemp("tokenizer")
    (local / "tokenizer.json").write_text(stack.exec("trainer", "cat", f"{MODEL}/tokenizer.json"))
    return toy.digit_token_ids(local)
