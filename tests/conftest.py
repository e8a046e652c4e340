# The fork's own test setup, for every test below `tests/` (tests_fabric, tests_pytorch, tests_patchset); this file is
# not at an upstream path. Upstream resets the environment and process group after each test in its own
# tests/tests_fabric/conftest.py and tests/tests_pytorch/conftest.py: the fork's copies of those tests need the same.
import importlib
import importlib.metadata
import os
import sys
import types
from pathlib import Path

import pytest


def _provide_runif(package: str) -> None:
    """Upstream's tests import ``RunIf`` from ``tests_<package>.helpers.runif``, a module of upstream's tree that this
    repository does not carry: the fork's suite makes one from the installed package's ``_runif_reasons``."""
    name = f"tests_{package}.helpers.runif"
    if name in sys.modules:
        return
    try:
        testing = importlib.import_module(f"lightning.{package}.utilities.testing")
    except ImportError:  # no fork installed: pytest_configure says so
        return

    def RunIf(**kwargs):  # noqa: N802 (the name upstream's tests import)
        reasons, marker_kwargs = testing._runif_reasons(**kwargs)
        return pytest.mark.skipif(bool(reasons), reason="needs " + ", ".join(reasons), **marker_kwargs)

    module = types.ModuleType(name)
    module.RunIf = RunIf
    sys.modules[name] = module


_provide_runif("fabric")
_provide_runif("pytorch")


# Tests in the patches' own test files that run whole pytest sessions or several processes: seconds each. The files stay
# as their pull requests have them (upstream has no `slow` marker), so the fork marks these here, by name, for the quick
# mode (`-m "not slow"`). The tests of error paths stay in the quick mode, and so do the files' in-process tests.
_SLOW_TESTS = {
    "tests_pytorch/checkpointing/test_checkpoint_pre_optimizer_step_ddp.py": {
        "test_ranks_that_log_in_different_batches_neither_hang_nor_pair_wrongly",
        "test_a_rank_without_the_monitored_value_defers_as_the_others_do",
    },
    "tests_pytorch/checkpointing/test_checkpoint_pre_optimizer_step_costs.py": {
        "test_no_copy_outlives_the_saves_that_can_use_it",
    },
}


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    for item in items:
        try:
            module = item.path.relative_to(tests).as_posix()
        except ValueError:  # a test outside the fork's suite (an inner pytest session's own)
            continue
        if item.originalname in _SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    try:  # the suite is about the fork: without it, one line now instead of a screen of errors minutes later
        version = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    if "+patchset" not in version:
        pytest.exit(f"install the fork first: `pip install .` (lightning is {version})", returncode=4)


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
