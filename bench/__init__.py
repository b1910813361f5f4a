"""Benchmarks: the lab, not the product. Each module runs as `python -m bench.<name>` (the
`scripts/bench-*` wrappers); they share `bench.common`. Nothing in shared/, services/ or
loadgen/ imports them, and no test does."""
