"""The chart's tests need helm: one fixture for the modules that run it (tests/chart/helm.py says where it
looks, and why a missing helm fails under CI=true instead of skipping)."""

import pytest

from tests.chart import helm


@pytest.fixture(scope="session")
def helm_binary() -> str:
    return helm.binary()
