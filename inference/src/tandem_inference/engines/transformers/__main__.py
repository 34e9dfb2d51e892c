"""`python -m tandem_inference.engines.transformers`: the transformers engine's server (as `tandem-engine`)."""

from tandem_inference.engines.transformers.server import main

if __name__ == "__main__":
    main()
