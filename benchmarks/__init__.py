"""ntkcore benchmark suites; run with ``python -m benchmarks --help``."""
