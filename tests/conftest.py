"""Test-suite setup: 8 fake CPU devices for the sharding tests, fp32 matmuls.

The device count must be set before JAX initialises its backend, so it lives here,
ahead of any test module's `import jax` side effects.
"""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# Exact fp32 matmuls everywhere in tests: references are compared at 1e-5 / 1e-4.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """Without -m, `slow` and `long` tests are skipped wherever pytest is pointed (the whole
    suite or one folder): select them with -m "slow and not long" or -m long."""
    if config.getoption("-m"):
        return
    for item in items:
        for mark in ("long", "slow"):
            if mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{mark}: select with -m {mark}"))
                break
