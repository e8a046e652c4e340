# The fork's own test setup, for every test below `tests/` (tests_fabric, tests_pytorch, tests_patchset); this file is
# not at an upstream path. Upstream wires the port-conflict rerun plugin in its own tests/tests_fabric/conftest.py and
# tests/tests_pytorch/conftest.py (patch 0005), and resets the environment and process group after each test there:
# the fork's copies of those tests need the same.
import contextlib
import importlib
import os
import sys
import types

import pytest


def _provide_runif(package: str) -> None:
    """Upstream's tests import ``RunIf`` from ``tests_<package>.helpers.runif``, a module of upstream's tree that this
    repository does not carry: the fork's suite makes one from the installed package's ``_runif_reasons``."""
    name = f"tests_{package}.helpers.runif"
    if name in sys.modules:
        return
    try:
        testing = importlib.import_module(f"lightning.{package}.utilities.testing")
    except ImportError:  # the tool's tests also run before the fork is installed
        return

    def RunIf(**kwargs):  # noqa: N802 (the name upstream's tests import)
        reasons, marker_kwargs = testing._runif_reasons(**kwargs)
        return pytest.mark.skipif(bool(reasons), reason="needs " + ", ".join(reasons), **marker_kwargs)

    module = types.ModuleType(name)
    module.RunIf = RunIf
    sys.modules[name] = module


_provide_runif("fabric")
_provide_runif("pytorch")


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
