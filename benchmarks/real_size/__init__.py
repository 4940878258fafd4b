"""Real-size models and the smoke run's probes: benchmark scaffolding, imported with ``benchmarks/`` on the path."""
