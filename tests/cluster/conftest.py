"""Fixtures for the live-view tests: a fake API server on loopback and views watching it."""

from __future__ import annotations

import pytest

from tests import fakekube
from webhook import settings as settings_mod
from webhook.cluster import kube


@pytest.fixture
def fake():
    with fakekube.FakeKube() as server:
        yield server


@pytest.fixture
def start_view(fake):
    """Start a KubeView on the fake server (short watches and backoff); closed after the test."""
    views = []

    def start(settings: settings_mod.Settings | None = None, **options):
        options.setdefault("watch_timeout", 5)
        options.setdefault("backoff", (0.05, 0.3))
        view = kube.KubeView.start(settings or settings_mod.Settings(), api_client=fake.api_client(), **options)
        views.append(view)
        return view

    yield start
    for view in views:
        view.close()


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory):
    from tests.admission import objects

    return objects.make_certs(tmp_path_factory.mktemp("certs") / "bundle")
