"""Entrypoint of the inference service: the controller and the gateway in one process.

    tandem-inference            (or: python -m tandem_inference.main)

They share a process so that a version switch is an in-memory change of the routing table,
not a Redis round trip per request. The engine is reached over HTTP only: with
`engine.kind = sglang` this process also launches SGLang from its own environment and
supervises it (`tandem_inference.launcher`); with `transformers` the engine runs separately
(`tandem-engine`). In shared GPU mode it also lends the GPU to the trainer on request
(`tandem_inference.sharing`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from tandem.errors import TandemError
from tandem.settings import InferenceSettings

log = logging.getLogger("tandem.inference")


async def serve(settings: InferenceSettings) -> None:
    """Build every part around one httpx client and serve the gateway until stopped."""
    import httpx
    import uvicorn
    from transformers import AutoTokenizer

    from tandem.adapters import AdapterStore
    from tandem.registry import Registry
    from tandem_inference.controller import Controller
    from tandem_inference.engine_client import EngineClient
    from tandem_inference.gateway import create_gateway_app
    from tandem_inference.launcher import Launcher
    from tandem_inference.routing import RoutingTable
    from tandem_inference.sharing import Admission, GpuSharing

    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(settings.engine.model)
    log.info("tokenizer of %s loaded in %.1f s", settings.engine.model, time.monotonic() - t0)
    conn = settings.redis.connect()
    async with httpx.AsyncClient() as http:
        engine = EngineClient.from_settings(http, settings.engine)
        table = RoutingTable(settings.engine.served_model_name)
        store = AdapterStore(settings.store.root)
        launcher = None
        if settings.engine.kind == "sglang":
            log_dir = Path(settings.store.root).parent / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            launcher = Launcher(settings, http, log_path=log_dir / "sglang.log")
            await launcher.start()
        controller = Controller(settings, conn, engine, store, table,
                                restart_engine=launcher.restart if launcher else None)
        if launcher is not None:
            launcher.on_restart = controller.reconcile
        background = []
        admission = None
        if launcher is not None:
            background.append(launcher.supervise)
        if settings.gpus.mode == "shared":
            admission = Admission()
            background.append(GpuSharing(settings, conn, engine, table, admission).run)
        app = create_gateway_app(settings, engine=engine, table=table, tokenizer=tokenizer,
                                 registry=Registry(conn), controller=controller,
                                 metrics=controller.metrics.registry, admission=admission,
                                 background=background)
        config = uvicorn.Config(app, host=settings.gateway.host, port=settings.gateway.port,
                                log_level="info", lifespan="on")
        try:
            await uvicorn.Server(config).serve()
        finally:
            if launcher is not None:
                launcher.stop()
    conn.close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call is noise
    settings = InferenceSettings()
    log.info("settings: %s", json.dumps(settings.redacted(), sort_keys=True))
    try:
        asyncio.run(serve(settings))
    except KeyboardInterrupt:
        pass
    except TandemError as exc:
        log.error("inference service stopped: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
