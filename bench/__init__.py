"""tandem's benchmarks: the suite (`python bench/suite.py`, `make bench`), the hot-load study, the GPU
harness and the report writers. bench/README.md says what each folder holds.

A package so that its folders import one another as `bench.<folder>.<module>`; a script run by its
path puts the repo root first on sys.path itself.
"""
