from lightning.fabric.utilities.testing import port_reruns


def pytest_configure(config):
    # rerun tests that fail with EADDRINUSE; the logic is importable so that users' suites can enable it too
    port_reruns.register(config)
