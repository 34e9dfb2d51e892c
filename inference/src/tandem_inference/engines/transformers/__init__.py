"""The transformers engine: a real engine (one base model, hot-swapped PEFT LoRA adapters, a
sampler) behind the subset of SGLang's HTTP API that tandem uses, so every part of tandem runs
the same way with or without SGLang.

Request and response shapes follow SGLang's, so tandem's engine client,
controller and gateway talk to this server and to SGLang the same way. Run it with
`python -m tandem_inference.engines.transformers` (or `tandem-engine`); settings come from `TANDEM_ENGINE__*`
(see tandem.settings.EngineSettings).

The runtime (no HTTP; torch is imported only when a model is loaded):

    runtime      HFEngine: ties the parts below together; thread-safe
    model        the base model and its tokenizer: loading, tokens, moving off the GPU and back
    lora         LoRA adapters: what the engine accepts, peft loading, activating, deleting
    admission    which requests may start, and waiting for running ones (unload, release)
    sampling     SamplingParams, Sequence, and the draw of one token per row
    decode       the decode loop: n samples of one prompt as one batch with a KV cache
    coalescing   identical requests waiting for the model run as one batch
    weights      full-weight reloads (/update_weights_from_disk)

The HTTP server:

    server           the app factory and `main`
    dependencies     what routes share (ServerState), the loaded engine, the admin check
    schemas          request bodies and what they ask of the sampler
    bridge           worker threads <-> the event loop, with the cancel of every running request
    replies          error statuses and shape, server-sent events
    openai_format    OpenAI's reply, chunk and logprobs shapes
    roots            the directories admin routes may read from
    metrics          Prometheus metrics
    routes_generate  /generate
    routes_openai    /v1/chat/completions, /v1/completions, /v1/models
    routes_admin     adapters, full weights, memory (behind the admin key)
    routes_info      health, server and model info, metrics
"""
