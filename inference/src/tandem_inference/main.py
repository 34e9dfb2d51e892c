"""Entrypoint of the inference service: the engine, the controller and the gateway in one process.

    tandem-inference            (or: python -m tandem_inference.main)

They share a process so that a version switch is an in-memory change of the routing table,
not a Redis round trip per request. The engine is reached over HTTP only: with
`engine.kind = sglang` this process also launches SGLang from its own environment and
supervises it (`tandem_inference.engines.own_engine`, `engines.launcher`); with `transformers`
the engine runs separately (`tandem-engine`), or, with `engine.launch`, as this process's
supervised child (one engine per replica). In shared GPU mode it also lends the GPU to the trainer on
request (`tandem_inference.controller.gpu_sharing`).

This module owns every lifecycle: it starts the replica's own engine, the controller, the
background loops (engine supervision, GPU sharing) and then serves the gateway; when the
gateway stops, whatever stopped it, they stop in the reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from tandem import logs
from tandem.errors import ConfigError, TandemError
from tandem.settings import GatewaySettings, InferenceSettings, load, service_arguments
from tandem_inference.bodies import is_loopback

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandem_inference.controller.service import Controller
    from tandem_inference.engines.base import Engine

log = logging.getLogger("tandem_inference.main")  # not __name__: that is "__main__" under python -m

#: Timeout of one Redis command of the gateway (runs, versions, episodes), in seconds.
GATEWAY_REDIS_TIMEOUT_S = 5.0

Job = Callable[[], Coroutine[Any, Any, None]]
"""A loop that runs for the service's lifetime (engine supervision, GPU sharing)."""


async def serve(settings: InferenceSettings) -> None:
    """Start every part around the engine's two connection pools, serve the gateway until
    stopped, then stop the parts in the reverse order."""
    import httpx
    import uvicorn

    from tandem.adapters import AdapterStore
    from tandem.registry import Registry
    from tandem_inference.controller.gpu_sharing import Admission, GpuSharing
    from tandem_inference.controller.heartbeat import Heartbeat
    from tandem_inference.controller.service import Controller
    from tandem_inference.engines import connect, own_engine
    from tandem_inference.engines.calls import ADMIN_CONNECTIONS, pool_limits
    from tandem_inference.engines.launcher import Launcher
    from tandem_inference.gateway.app import create_gateway_app
    from tandem_inference.gateway.schemas import MAX_N
    from tandem_inference.routing import RoutingTable

    t0 = time.monotonic()
    tokenizer = load_tokenizer(settings.engine.model)
    log.info("tokenizer of %s loaded in %.1f s", settings.engine.model, time.monotonic() - t0)
    conn = settings.redis.connect()
    # the gateway's reads (runs, versions, episodes) on a connection of their own with a short
    # timeout: while Redis hangs a request waits seconds for its answer, not the controller's 30
    # (`conn` has just answered: a ping here could only fail on timing)
    gateway_conn = settings.redis.connect(ping=False, timeout_s=GATEWAY_REDIS_TIMEOUT_S)
    # Rollouts and admin calls (loads, unloads, health) in pools of their own: the controller's
    # calls never wait behind rollouts. The rollout pool has a connection for every engine call
    # the gateway admits (n calls per request with gateway.fan_out_n, one without).
    generate_calls = max(settings.gateway.max_in_flight_sequences, MAX_N)
    try:
        async with (
            httpx.AsyncClient(limits=pool_limits(generate_calls)) as rollouts,
            httpx.AsyncClient(limits=pool_limits(ADMIN_CONNECTIONS)) as http,
            contextlib.AsyncExitStack() as running,  # stops what started, newest first
        ):
            engine = connect(settings.engine, rollouts, admin_http=http)
            table = RoutingTable(settings.engine.served_model_name)
            jobs: list[Job] = []
            launcher = None
            own = own_engine(settings)
            if own is not None and own.log_name is not None:
                log_dir = Path(settings.store.root).parent / "logs"
                launcher = Launcher(settings, http, argv=own.argv, env=own.env,
                                    log_path=log_dir / f"{own.log_name}.log", pid_path=log_dir / f"{own.log_name}.pid")
            elif own is not None:  # logging to this process's output
                launcher = Launcher(settings, http, argv=own.argv, env=own.env)
            if launcher is not None:
                running.callback(launcher.stop)  # the engine stops with this service, whatever ends it
                await launcher.start()
                jobs.append(launcher.supervise)
            controller = Controller(settings, conn, engine, AdapterStore(settings.store.root), table,
                                    restart_engine=launcher.restart if launcher else None)
            if launcher is not None:
                launcher.on_restart = controller.reconcile
                launcher.on_down = controller.engine_lost
            running.push_async_callback(controller.stop)
            controller.start()
            admission = None
            if settings.gpus.leased:  # not when it serves while the trainer steps: nothing changes hands
                admission = Admission()
                jobs.append(GpuSharing(settings, conn, engine, table, admission).run)
            heartbeat = Heartbeat(settings, conn, table, ready=lambda: _ready(engine, controller))
            controller.on_change = heartbeat.beat
            jobs.append(heartbeat.run)
            for job in jobs:
                running.push_async_callback(_cancelled, asyncio.create_task(job()))
            app = create_gateway_app(settings, engine=engine, table=table, tokenizer=tokenizer,
                                     registry=Registry(gateway_conn), controller=controller,
                                     metrics=controller.metrics.registry, admission=admission)
            config = uvicorn.Config(app, host=settings.gateway.host, port=settings.gateway.port,
                                    log_config=None, lifespan="on")  # tandem.logs' format and level
            await uvicorn.Server(config).serve()
    finally:
        conn.close()
        gateway_conn.close()


async def _ready(engine: Engine, controller: Controller) -> bool:
    """What /ready answers: the engine answers, the controller has reconciled, and this replica
    serves what the other ready replicas serve (tandem_inference.controller.agreement)."""
    return bool(controller.reconciled) and controller.agreement.in_rotation and bool(await engine.health())


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel a background loop and wait until it has stopped."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def check_exposure(settings: GatewaySettings) -> None:
    """Refuse a gateway reachable beyond loopback without an API key, unless allowed outright.

    In a container the gateway binds 0.0.0.0 and the host publishes its port: `published_host`
    (compose sets it from GATEWAY_BIND) is then the address that counts.
    """
    host = settings.published_host or settings.host
    has_key = settings.api_key is not None and bool(settings.api_key.get_secret_value())
    if has_key or settings.allow_unauthenticated or is_loopback(host):
        return
    field = "gateway.published_host" if settings.published_host else "gateway.host"
    raise ConfigError(
        f"the gateway would serve {host!r} ({field}) without an API key: set TANDEM_GATEWAY__API_KEY "
        "(GATEWAY_API_KEY in the compose .env), bind to 127.0.0.1, or set "
        "TANDEM_GATEWAY__ALLOW_UNAUTHENTICATED=true to serve anyone who can reach it"
    )


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The served model's tokenizer (the gateway's chat templates and text); a model it cannot
    load is a ConfigError naming the setting, instead of the hub client's traceback."""
    from transformers import AutoTokenizer

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        missing = model.startswith(("/", ".")) and not Path(model).exists()
        where = "no such directory" if missing else " ".join(str(exc).split())  # one line in the log
        raise ConfigError(
            f"cannot load the tokenizer of engine.model {model!r} (TANDEM_ENGINE__MODEL): {where}; give the "
            "directory of the model the engine serves (config.json and the tokenizer's files), as the engine sees it"
        ) from exc
    return tokenizer


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    service_arguments("tandem-inference", "inference", "The inference service: the OpenAI-compatible gateway, "
                      "and the controller that hot-loads each adapter version into the engine.")
    logs.configure()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call is noise
    try:
        settings = load(InferenceSettings)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    log.info("settings: %s", json.dumps(settings.redacted(), sort_keys=True))
    # NOTE: uvicorn (0.54) shuts down gracefully on SIGTERM, then restores the handler it found and
    # raises the signal again. With the default handler that kills the process on the spot, so no
    # `finally` after serve() would run and the engine would be left running. This handler turns
    # SIGTERM into SystemExit, which unwinds serve() and stops the engine, also when SIGTERM comes
    # before uvicorn has started (while the engine boots). SIGINT already unwinds (KeyboardInterrupt).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        check_exposure(settings.gateway)
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        pass
    except TandemError as exc:
        log.error("inference service stopped: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
