# The fork's own test setup, for every test below `tests/` (tests_fabric, tests_pytorch, tests_patchset); this file is
# not at an upstream path. Upstream wires the port-conflict rerun plugin in its own tests/tests_fabric/conftest.py and
# tests/tests_pytorch/conftest.py (patch 0005), and resets the environment and process group after each test there:
# the fork's copies of those tests need the same.
import contextlib
import os
import sys

import pytest


def pytest_configure(config):
    with contextlib.suppress(ImportError):  # the tool's tests also run before the fork is installed
        from lightning.fabric.utilities.testing import _port_reruns

        _port_reruns.register(config)


@pytest.fixture(autouse=True)
def restore_environment_and_process_group():
    """A test that starts a process group in this process (``ModelParallelStrategy`` with one device, say) leaves
    ``MASTER_PORT`` set and its store listening: the next test would reuse that port and fail with EADDRINUSE."""
    environ = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(environ)
    if "torch" in sys.modules:
        import torch.distributed

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
