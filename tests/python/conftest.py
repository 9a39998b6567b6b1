import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A fresh, seeded generator per test: inputs differ between tests but runs are repeatable."""
    return torch.Generator().manual_seed(torch.initial_seed() % (2**31))
