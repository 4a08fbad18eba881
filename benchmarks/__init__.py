"""fastckpt benchmarks: kernel efficiency (benchmarks.ops) and, later, training workloads."""
