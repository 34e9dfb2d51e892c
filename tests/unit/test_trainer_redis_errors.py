"""Where the trainer talks to Redis itself, a Redis that fails reaches it as `BackendUnavailable`.

The Redis here is a loopback port nobody listens on: every command fails to connect, the way
a Redis that is down does. Each call must raise tandem's error, naming what it tried and the
Redis URL, not redis-py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from helpers.loopback import free_port
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.adapters import AdapterStore, Manifest
from tandem.errors import BackendUnavailable
from tandem_trainer.publisher import Publisher
from tandem_trainer.recovery import Liveness, any_trainer_alive, owner_alive, recover_abandoned
from tandem_trainer.run_lock import RunLock
from tandem_trainer.worker import claim_name


@pytest.fixture(scope="module")
def down() -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))


def _calls(conn: redis.Redis, tmp: Path) -> dict[str, Callable[[], object]]:
    manifest = Manifest(run="r", version=1, parent=0, step=1, job_id="j", base_model="m", lora_rank=4)
    return {
        "run lock acquire": lambda: RunLock(conn, "r", "me#1", lambda owner: True).acquire(1000, 1),
        "run lock release": lambda: RunLock(conn, "r", "me#1", lambda owner: True).release(),
        "liveness beat": lambda: Liveness(conn, "w").beat(),
        "owner alive": lambda: owner_alive(conn, "w#1"),
        "any trainer alive": lambda: any_trainer_alive(conn),
        "recover abandoned": lambda: recover_abandoned(conn),
        "claim name": lambda: claim_name(conn, "w"),
        "announced": lambda: Publisher(conn, AdapterStore(tmp)).announced(manifest),
    }


CALLS = sorted(_calls(redis.Redis(), Path()))


@pytest.mark.parametrize("call", CALLS)
def test_a_redis_that_is_down_raises_backend_unavailable(call: str, down: redis.Redis, tmp_path: Path) -> None:
    port = down.connection_pool.connection_kwargs["port"]
    with pytest.raises(BackendUnavailable) as info:
        _calls(down, tmp_path)[call]()
    assert f"127.0.0.1:{port}" in str(info.value)
    assert isinstance(info.value.__cause__, redis.RedisError)
