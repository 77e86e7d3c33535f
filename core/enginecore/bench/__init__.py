"""Benchmarks shipped with the package (``enginecore bench ...``)."""
