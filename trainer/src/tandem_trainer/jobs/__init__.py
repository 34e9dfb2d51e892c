"""The jobs the trainer runs: one module per kind, behind one dispatch.

    kinds.py         the dispatch: every kind by name (`KINDS`)
    base.py          what a kind is (`JobKind`: parse, run, end line) and an attempt at a job (`Attempt`)
    runner.py        `Trainer`: the frame every job runs in (validate, run the kind, the start, end
                     and failed lines, the `train_failed` event, the job metrics)
    context.py       `JobContext`: the resident model, store and Redis; a job's run, the run's lock,
                     the GPU in shared mode, telling the other ranks
    versions.py      where training resumes; publishing a trained version, its optimizer state,
                     its step in the metrics and the experiment tracker
    failures.py      what names a failed job, what its failure is reported as, whether a retry may help
    train.py         the `train` kind: one GRPO step from trajectory groups
    train_checks.py  what a train job is checked for before it trains
    forward_backward.py, optim_step.py, load_state.py
                     Tinker's training calls (tandem.tinker_jobs): gradients held with the run, one
                     Adam step published, a version loaded as the run's next; tinker_common.py
                     what they share (one process only, the run's newest version activated)

A new kind is a module here with a `JobKind` subclass: its `name`, `parse` (the payload's pydantic
model, which lives in `tandem` so that the sending side validates with the same), `run` (the work,
on the `JobContext`: `ctx.run_spec`, `ctx.locked`, `ctx.device`, `versions.publish` when it
publishes a version) and `log_end`; an entry in `kinds.KINDS`; and a job function in worker.py
that runs it by name (`_run_job`), which the queue's guard (`tandem.jobs.GuardedJob`) must allow
and the sending side must enqueue. Nothing is imported here, so a module imports only what it uses.
"""
