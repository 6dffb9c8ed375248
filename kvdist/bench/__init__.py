"""Benchmarks run by ``python -m kvdist bench NAME``; each module has ``main(argv) -> int``."""
