"""One module per suite; each defines ``run(cfg: benchmarks._harness.Config) -> list[dict]``."""
