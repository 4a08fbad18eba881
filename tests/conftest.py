import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores as torch's intra-op threads (one each with
    `-n 2` on 2 cores), and so do the processes a test starts (OMP_NUM_THREADS). Left at torch's default, every
    worker runs as many threads as there are cores, and each small op's parallel region spins waiting for a
    thread the other worker holds: with `-n 2` on 2 cores the suite ran 13.9 min so, 3.9 min with a thread each."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // int(workers))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests skip themselves on machines without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """The test on one intra-op thread (a fixed summation order for tight fp32 comparisons), restored after;
    a module takes it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    from tests.helpers import num_threads  # here: collecting the suite must not import fastckpt

    with num_threads(1):
        yield
