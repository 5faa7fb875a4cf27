"""Fixtures every agent test shares: a short plugin folder (unix socket paths are short) and a fake kubelet."""

import pytest

from tests.agent import fakekubelet


@pytest.fixture
def plugin_dir():
    path = fakekubelet.short_tempdir()
    yield path
    fakekubelet.remove_tree(path)


@pytest.fixture
def kubelet(plugin_dir):
    fake = fakekubelet.FakeKubelet(plugin_dir).start()
    yield fake
    fake.stop()
