"""Tinker's training and sampling API over tandem, for the `tinker` SDK and tinker-cookbook.

A Tinker model is a tandem run; `forward_backward`, `optim_step` and `load_weights` are trainer
jobs (tandem.tinker_jobs) applied in each model's seq_id order; every optim_step publishes the
run's next immutable version; `save_weights_for_sampler` names a version and completes once it
serves; `asample` generates through the gateway. Futures live in Redis (state.py), so any
process of the service answers for them. Modules:

    app        the FastAPI app; every unknown route answered in Tinker's error shape
    routes     the /api/v1/ routes, bodies parsed with the SDK's own types
    service    the calls: models as runs, jobs in order, saves, sampling sessions
    order      one model's requests in seq_id order, parked until their turn
    futures    resolving a future from its job, its version, its stored result
    sampling   asample through the gateway's /v1/completions
    wire       the protobuf wire format (forward_backward in, ForwardBackwardOutput / SampleResponse out)
    state      the Redis records; replies and errors: the error shape and the refusals
    main       `python -m tandem_inference.tinker`
"""
