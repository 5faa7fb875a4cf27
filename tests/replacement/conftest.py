"""Fixtures for the re-placement tests: a fake API server on loopback."""

from __future__ import annotations

import pytest

from tests import fakekube


@pytest.fixture
def fake():
    with fakekube.FakeKube() as server:
        yield server
