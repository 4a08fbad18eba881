import pytest
import torch


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
