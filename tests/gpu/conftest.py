"""GPU tests: skipped cleanly where torch has no CUDA device (CI, laptops)."""

import pytest

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the control-plane-only environment has no torch: do not even import the tests
    _HAS_CUDA = False
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
