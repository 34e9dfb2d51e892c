"""The OpenAI-compatible gateway: rollouts go in by run name, token ids and logprobs come out.

Clients name a run (`model="digits"`), a pinned version (`digits@v7`) or the base model; the
routing table picks the adapter. The gateway applies the chat template itself with the base
model's tokenizer and asks the engine (tandem_inference.engines) for prompt ids, so the response
can carry the exact prompt and completion token ids and their logprobs for training, with no
re-tokenisation anywhere. Responses are OpenAI-shaped (any OpenAI client works) plus a
`tandem` object and `x-tandem-run` / `x-tandem-version` / `x-tandem-replica` headers saying which
version of the run, on which replica, served.

A request's `n` samples are one engine call, or n calls of one sample with `gateway.fan_out_n`
(for engines whose unload can deadlock after n > 1 sampling). Generation is admitted
within a budget (capacity.py): beyond it requests wait in a bounded queue, then are refused with
429 and Retry-After. A client that leaves ends its engine calls, streamed or not, so the engine
stops generating for nobody. Each request holds the in-flight count of its version until its
response (or stream) ends, so the controller never unloads a version under a running request.

A chat request may name an `episode` (episodes.py): later turns send the whole conversation,
but only the new messages are rendered, so the ids a trainer gets are the ids the model sampled.

Bad input is a 4xx in OpenAI's error shape naming the field (bodies.py); a generation the
engine refuses for what the client asked (a prompt longer than the context) is a 400, not a 502.

The gateway serves; it starts nothing. The inference service (tandem_inference.main) starts
the engine, the controller and the gateway, and stops them in the reverse order.

    schemas         request bodies (chat, completions) and their limits
    prompts         prompts as token ids: the chat template, episode deltas, the vocabulary check
    tool_calls      tool calls parsed from the model's text into OpenAI's `tool_calls`
    episodes        multi-turn episodes: their Redis store, and each turn's ids, mask and logprobs
    outputs         one choice folded from the engine's whole result or stream chunks; usage
    responses       OpenAI-shaped replies, chunks, logprobs and the `tandem` extension
    generation      an admitted request and its engine calls (one call, or n fanned out)
    streaming       server-sent events of a streamed reply, ended when the client leaves
    cancellation    an unstreamed reply cancelled when the client leaves
    metrics         Prometheus metrics and the middleware that counts generation requests
    error_replies   OpenAI-shaped error replies and the app's exception handlers
    service         `Gateway`: admission, resolution, prompts, sampling, generation
    routes          the HTTP routes, as APIRouters (generation, runs, operations)
    app             `create_gateway_app`, the FastAPI app of one gateway
"""
