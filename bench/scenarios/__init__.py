"""The suite's scenarios, one module each with `run(ctx) -> result` (bench/benchlib.py's Ctx)."""
