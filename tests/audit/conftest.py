"""Fixtures for the audit and status tests: the fake API server with a populated cluster, and a kubeconfig."""

from __future__ import annotations

import pytest

from tests import fakekube
from tests.audit import world


@pytest.fixture
def fake():
    with fakekube.FakeKube() as server:
        world.populate(server)
        yield server


@pytest.fixture
def kubeconfig(fake, tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(world.kubeconfig(fake))
    return str(path)
