"""Client side: CLI client and benchmarks."""
