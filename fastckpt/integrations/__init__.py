"""Entry points for the systems users already train with (`hf`, `deepspeed`).

Each submodule imports its package lazily, so `import fastckpt` works without any of them.
"""
