"""Operators' overlays for the tests: a kustomization with the device-policy lists changed, as docs/install.md says.

deploy/base keeps what the admission policies trust in a ConfigMap that kustomize reads and never
emits (device-policy.yaml) and writes each value into a policy variable with `replacements`. An
operator changes a list in an overlay of their own: a patch of that ConfigMap, and the replacements of
the keys it changes, copied from the kustomization that holds them (the base's ran when the base was
built). ``render`` writes exactly such an overlay in a temporary folder and renders it with
tests/deploy/rendering.py, which tests/deploy/test_rendered.py holds to `kubectl kustomize`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from pathlib import Path

import yaml

from tests.deploy import rendering

CONFIG_MAP = "gpushard-device-policy"
KEYS = ("exemptNamespaces", "exemptServiceAccounts", "allowedDeviceClasses", "gpushardDeviceClass")


def replacements(folder: Path) -> list[dict]:
    """The replacements whose source is the device-policy ConfigMap, in ``folder`` and below it."""
    folder = folder.resolve()
    data = rendering.kustomization(folder)
    found = []
    for entry in data.get("resources", []):
        if (folder / entry).is_dir():
            found += replacements(folder / entry)
    found += [r for r in data.get("replacements", []) if r["source"].get("name") == CONFIG_MAP]
    return found


def local_config_map(folder: Path) -> dict:
    """The device-policy ConfigMap as ``folder`` leaves it, before kustomize drops it from the output."""
    found = [o for o in rendering._render(folder) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == CONFIG_MAP]
    assert len(found) == 1, f"{folder}: {len(found)} ConfigMaps {CONFIG_MAP}"
    return found[0]


def overlay(folder: Path, at: Path, **lists: str) -> dict:
    """The kustomization.yaml an operator writes in ``at`` to set ``lists`` (key: space-separated names) over
    ``folder`` (named relative to ``at``: kustomize refuses an absolute path to a base)."""
    unknown = set(lists) - set(KEYS)
    assert not unknown, unknown
    ops = [{"op": "add", "path": f"/data/{key}", "value": value} for key, value in sorted(lists.items())]
    chosen = [r for r in replacements(folder) if r["source"]["fieldPath"].removeprefix("data.") in lists]
    assert {r["source"]["fieldPath"].removeprefix("data.") for r in chosen} == set(lists), \
        f"{folder}: no replacement writes {sorted(set(lists) - {r['source']['fieldPath'][5:] for r in chosen})}"
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(folder.resolve(), at.resolve())],
            "patches": [{"target": {"version": "v1", "kind": "ConfigMap", "name": CONFIG_MAP},
                         "patch": json.dumps(ops)}],
            "replacements": chosen}


@functools.cache
def _render(folder: str, items: tuple[tuple[str, str], ...]) -> tuple[dict, ...]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(overlay(Path(folder), Path(tmp), **dict(items))))
        return tuple(rendering.render(Path(tmp)))


def render(folder: Path, **lists: str) -> list[dict]:
    """The objects of ``folder`` with ``lists`` set by an operator's overlay (each rendering made once)."""
    return copy.deepcopy(list(_render(str(folder.resolve()), tuple(sorted(lists.items())))))
