"""Reference implementations the benchmark suites compare ntkcore against (written here)."""
