"""fastckpt benchmark suite: `python -m benchmarks` (see benchmarks/__main__.py)."""
