"""GPU benchmarks (not run in CI): each writes a results JSON with provenance and a markdown table."""
