"""Benchmarks: workloads, runners and reports (each writes JSON under results/)."""
