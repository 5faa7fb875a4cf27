"""Runs the pinned helm on charts/gpushard for the chart's tests, and finds the binary they need.

helm is `.venv/bin/helm` (`make .venv/bin/helm`, from .ci/install_helm.py) or $GPUSHARD_HELM. Outside CI a
missing helm skips the chart's tests with one line; under CI=true it fails them, so CI never passes by
running none.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gpushard"
NAMESPACE = "gpushard-system"
RELEASE = "gpushard"


def _path() -> Path:
    explicit = os.environ.get("GPUSHARD_HELM")
    return Path(explicit) if explicit else ROOT / ".venv" / "bin" / "helm"


def _missing() -> str | None:
    path = _path()
    if path.is_file() and os.access(path, os.X_OK):
        return None
    return f"helm is not at {path}: `make .venv/bin/helm` installs it (or set GPUSHARD_HELM)"


def binary() -> str:
    """The helm to run; fails when there is none (modules call skip_module_without_helm first)."""
    missing = _missing()
    if missing:
        pytest.fail(missing, pytrace=False)
    return str(_path())


def skip_module_without_helm() -> None:
    """Outside CI, a module that needs helm is skipped, with one line, when there is none; under CI=true it
    runs, and each of its tests fails (binary)."""
    missing = _missing()
    if missing and os.environ.get("CI") != "true":
        pytest.skip(missing, allow_module_level=True)


def kubectl() -> str | None:
    """A kubectl for `kubectl kustomize`: $GPUSHARD_KUBECTL, else the one on PATH, else None."""
    return os.environ.get("GPUSHARD_KUBECTL") or shutil.which("kubectl")


def run(*args: str, values: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """helm ARGS [-f values.json]; with check, a failure shows helm's own message."""
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if values is not None:
            path = Path(tmp) / "values.json"
            # JSON is YAML: helm reads it as a values file.
            path.write_text(json.dumps(values))
            extra = ["-f", str(path)]
        done = subprocess.run([binary(), *args, *extra], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HELM_CACHE_HOME": tmp, "HELM_CONFIG_HOME": tmp,
                                   "HELM_DATA_HOME": tmp})
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done


@functools.cache
def _template(values_json: str, namespace: str) -> str:
    return run("template", RELEASE, str(CHART), "--namespace", namespace,
               values=json.loads(values_json)).stdout


def template(values: dict | None = None, namespace: str = NAMESPACE) -> list[dict]:
    """The objects `helm template` renders with these values (each rendering is made once per run)."""
    text = _template(json.dumps(values or {}, sort_keys=True), namespace)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def ident(obj: dict) -> tuple[str, str, str, str]:
    """(API group, kind, namespace, name): what names one object in a cluster."""
    meta = obj["metadata"]
    return obj["apiVersion"].rpartition("/")[0], obj["kind"], meta.get("namespace", ""), meta["name"]


def is_test_hook(obj: dict) -> bool:
    annotations = obj["metadata"].get("annotations") or {}
    return annotations.get("helm.sh/hook") == "test"
