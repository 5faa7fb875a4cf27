"""Fixtures for the admission tests: settings, a static view, apps, certificates and servers."""

from __future__ import annotations

import pytest

from tests.admission import objects
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.cluster import static


@pytest.fixture
def cluster_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(objects.CLUSTER_YAML)
    return path


@pytest.fixture
def view(cluster_file):
    return static.StaticView(static.load(cluster_file, 100))


@pytest.fixture
def app(view):
    return app_mod.create_app(settings_mod.Settings(), view)


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return objects.make_certs(tmp_path_factory.mktemp("certs") / "bundle")


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    path.write_text(objects.CLUSTER_YAML)
    return path


@pytest.fixture(scope="module")
def server(certs, module_cluster):
    """One real `gpushard serve` (two workers) shared by a module's tests."""
    srv = objects.Server(certs, module_cluster, workers=2, threads=4)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
