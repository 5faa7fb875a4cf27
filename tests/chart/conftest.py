"""The chart's tests need helm: one check for all of them (tests/chart/helm.py says where it looks)."""

import pytest

from tests.chart import helm


@pytest.fixture(autouse=True, scope="session")
def helm_binary() -> str:
    return helm.binary()
