"""The GPU harness: checks and measurements of the real engines and trainer, run from the repo root on a
GPU host, and the scripts that build that host's environments from images/locks/."""
