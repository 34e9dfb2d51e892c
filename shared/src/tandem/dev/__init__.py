"""Development tools: the whole stack as local processes (`tandem up`), the `tandem` command and
the toy task that the demo, the tests and the GPU check train on.

They sit apart from the SDK (`tandem.Client`, settings, schemas, errors at the top level)
because an RL loop never needs them; like the rest of the light package they never import
torch (the tiny model is built by the trainer package, in a subprocess).
"""
