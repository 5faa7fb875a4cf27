"""Fixtures for the re-placement tests: a fake API server on loopback, and every replacer a test started stopped
when it ends."""

from __future__ import annotations

import pytest

from tests import fakekube


@pytest.fixture
def fake():
    with fakekube.FakeKube() as server:
        yield server


# The replacers the running test made (its module appends each): their watches stop when the test ends.
STARTED: list = []


@pytest.fixture(autouse=True)
def _stand_by_after():
    yield
    while STARTED:
        STARTED.pop().stand_by()
