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
