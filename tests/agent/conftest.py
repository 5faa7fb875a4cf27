"""Fixtures the agent tests share: a short plugin folder (unix socket paths are short), a fake kubelet, the
local API server, and a fake NVML library on the C ABI."""

import os
import pathlib
import shutil
import subprocess

import pytest

from tests import fakekube
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


@pytest.fixture
def api():
    """The local API server on the wire (tests/fakekube.py)."""
    with fakekube.FakeKube() as server:
        yield server


@pytest.fixture
def fake_nvml(tmp_path):
    """A fake libnvidia-ml.so.1 built from fakenvml.c: the env that loads it, and its control folder."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the fake NVML library")
    lib, control = tmp_path / "lib", tmp_path / "control"
    lib.mkdir()
    control.mkdir()
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"),
                    "-Wl,-soname,libnvidia-ml.so.1", str(pathlib.Path(__file__).with_name("fakenvml.c"))],
                   check=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
    env.update(LD_LIBRARY_PATH=str(lib), FAKE_NVML_DIR=str(control))
    return env, control
