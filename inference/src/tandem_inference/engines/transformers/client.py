"""The client of tandem's transformers engine, behind `Engine`.

The transformers engine (this package's server) serves the native routes of SGLang's API that
tandem uses, with the same shapes (the `/generate` replies, the admin routes, /server_info), so
that one client and one set of tests cover both: its client is SGLang's, under its own name, so
that callers and settings name the engine they run and the two can part where they must. Its
refusals are in SGLang's words too (admission.NOT_LOADED for an adapter it does not hold), so
SGLang's client reads them.
"""

from __future__ import annotations

from tandem_inference.engines.sglang import SGLangEngine


class TransformersEngine(SGLangEngine):
    """Async client of one transformers engine; one per process."""
