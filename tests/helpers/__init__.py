"""What tests of every tier share, one module per thing (tests/ is on sys.path: `from helpers.x import y`).

- `loopback`: a free port, and an ASGI app served by uvicorn in a thread.
- `waiting`: a bounded wait for a condition.
- `redis_server`: a redis-server of a test's own, which the test may stop and start again.
- `jobs`: train jobs of random tokens, and their state on rq's queue.
- `workers`: trainer worker processes (`python -m tandem_trainer.main`) with their logs.
- `servers`: the engine and the gateway on loopback, wired as the inference service wires them.
- `adapters`: LoRA versions published and announced the way the trainer does it.
- `bench`: the modules of bench/ (scenarios, hot-load study, GPU harness, reports), imported as the `bench` package.

Random LoRA adapters come from `tandem_trainer.tiny_model.build_random_adapter`, which the
benchmarks use too.
"""
