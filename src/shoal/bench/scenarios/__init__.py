"""The benchmark scenarios. Each module registers its scenarios with `shoal.bench.registry.scenario`."""
