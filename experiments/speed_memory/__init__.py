"""Speed and memory measurements (benchmarks that print figures; never timed tests)."""
