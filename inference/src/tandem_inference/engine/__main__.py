"""`python -m tandem_inference.engine`: the transformers engine's server (as `tandem-engine`)."""

from tandem_inference.engine.server import main

if __name__ == "__main__":
    main()
