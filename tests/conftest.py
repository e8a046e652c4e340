# The fork's own wiring of the port-conflict rerun plugin, for every test below `tests/` (tests_fabric, tests_pytorch,
# tests_patchset). Upstream wires it in its own tests/tests_fabric/conftest.py and tests/tests_pytorch/conftest.py
# (patch "tests: rerun tests that fail with EADDRINUSE"); this file is not at an upstream path.
import contextlib


def pytest_configure(config):
    with contextlib.suppress(ImportError):  # the tool's tests also run before the fork is installed
        from lightning.fabric.utilities.testing import port_reruns

        port_reruns.register(config)
