"""Run a test body in several processes joined by a gloo group on 127.0.0.1 (CPU)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, body: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # two processes on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = body(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Done and saved: leave without the interpreter's teardown, where a C++ thread still joinable (seen twice on
    # 2026-12-06, in ranks that had run the profiler) aborts the process with "terminate called without an
    # active exception" after the test body passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_processes(body: Callable[..., Any], *args: Any, world_size: int = 2) -> list[Any]:
    """Call `body(rank, world_size, *args)` in `world_size` fresh processes; return each rank's result.

    `body` must be a module-level function (it is pickled into spawned processes); its result
    is saved with torch.save, so tensors and plain containers come back. A failure in any rank
    raises here with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), out_dir, body, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False) for rank in range(world_size)]
