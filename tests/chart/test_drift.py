"""The chart and deploy/ never drift apart: each kustomization's objects, and the chart's with the values
that stand for it, are the same objects.

We test:
- every folder of deploy/overlays has its values here, so a new overlay cannot go without a chart twin;
- for deploy/base, each overlay and the operator's overlays of examples/ (examples/device-policy: the
  lists the admission policies trust, set there by kustomize replacements and here by values),
  `helm template` with its values renders every object `kubectl
  kustomize` renders (but the Namespace, which the chart does not make), and each equal to its twin after
  the normalisation below; and nothing more, but helm's test hook;
- the chart's copy of the Grafana dashboard is byte for byte the monitoring overlay's.

Normalised, and only this (each is what a Helm release changes, or means the same to the programs):
- the labels every chart object carries for Helm (managed-by, instance, version, helm.sh/chart): the
  release's bookkeeping, never part of a selector;
- the annotation helm.sh/resource-policy, which changes only what `helm uninstall` does;
- the Namespace object: the chart installs into the release's namespace and does not own it
  (docs/helm.md);
- config.yaml of ConfigMap gpushard-config, compared as the settings webhook/settings.py reads from it:
  the chart writes every key out from values, an overlay writes the keys it sets, and the programs read
  the file only through settings.from_mapping (comments, order and spelled-out defaults mean nothing).
Without kubectl, kustomize's output comes from tests/deploy/rendering.py, which tests/deploy/test_rendered.py
checks against kubectl wherever kubectl is.
"""

from __future__ import annotations

import copy
import difflib

import pytest
import yaml

from tests.chart import helm
from tests.chart.kustomizations import DEPLOY, EXAMPLES, VALUES, kustomize
from webhook import settings

helm.skip_module_without_helm()
pytestmark = pytest.mark.usefixtures("helm_binary")

HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version",
               "helm.sh/chart")
HELM_ANNOTATIONS = ("helm.sh/resource-policy",)
CONFIG = ("", "ConfigMap", helm.NAMESPACE, "gpushard-config")


def read_config(obj: dict) -> dict:
    """gpushard-config with config.yaml replaced by the settings read from it."""
    obj = copy.deepcopy(obj)
    text = obj["data"]["config.yaml"]
    obj["data"]["config.yaml"] = settings.from_mapping(yaml.safe_load(text), source="config.yaml")
    return obj


def from_chart(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    meta = obj["metadata"]
    for key, names in (("labels", HELM_LABELS), ("annotations", HELM_ANNOTATIONS)):
        for name in names:
            (meta.get(key) or {}).pop(name, None)
        if key in meta and not meta[key]:
            del meta[key]
    return obj


def by_ident(objects: list[dict]) -> dict[tuple, dict]:
    out = {}
    for obj in objects:
        assert helm.ident(obj) not in out, f"{helm.ident(obj)} rendered twice"
        out[helm.ident(obj)] = read_config(obj) if helm.ident(obj) == CONFIG else obj
    return out


def show(obj: dict) -> list[str]:
    return yaml.safe_dump(obj, sort_keys=True, default_flow_style=False, width=200).splitlines()


def test_every_overlay_has_values():
    overlays = {f"overlays/{p.name}" for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file()}
    missing = sorted(overlays - set(VALUES))
    assert not missing, f"no chart values for {missing}: add them to VALUES here, and the chart the objects"


FOLDERS = {**{f"deploy/{folder}": values for folder, values in VALUES.items()}, **EXAMPLES}


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_chart_renders_the_kustomization(folder):
    want = by_ident([o for o in kustomize(helm.ROOT / folder) if o["kind"] != "Namespace"])
    got = by_ident([from_chart(o) for o in helm.template(FOLDERS[folder]) if not helm.is_test_hook(o)])
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing, f"{folder} has objects the chart does not render with {FOLDERS[folder]}: {missing}"
    assert not extra, f"the chart renders objects {folder} does not have: {extra}"
    drifted = []
    for key in sorted(want):
        if want[key] != got[key]:
            diff = difflib.unified_diff(show(want[key]), show(got[key]), folder, "chart", lineterm="")
            drifted.append(f"{key}:\n" + "\n".join(diff))
    assert not drifted, f"{len(drifted)} objects differ from {folder}:\n" + "\n\n".join(drifted)


def test_the_dashboard_is_the_monitoring_overlays():
    copied = (helm.CHART / "files" / "dashboard.json").relative_to(helm.ROOT)
    original = (DEPLOY / "overlays" / "monitoring" / "dashboard.json").relative_to(helm.ROOT)
    assert (helm.ROOT / copied).read_bytes() == (helm.ROOT / original).read_bytes(), (
        f"{copied} differs from {original}: copy it over (cp {original} {copied})")
