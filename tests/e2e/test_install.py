"""We test, on a real kube-apiserver, kube-controller-manager and kube-scheduler, that the install is accepted:
- `kubectl apply -k deploy/base` exits 0 and every object it names is stored (every admission policy compiled);
- every overlay applies (server-side dry run: the API server compiles and validates what it would store), with
  stand-in CRDs for the kinds other projects define (Prometheus operator, cert-manager);
- every ValidatingAdmissionPolicy's status.typeChecking, filled in by the controller manager, has no warning;
- an install taken over by server-side apply (as GitOps tools do) has no conflict, and `kubectl diff
  --server-side` then shows nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.e2e import components

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.parent.name for p in (ROOT / "deploy" / "overlays").glob("*/kustomization.yaml"))
# Kinds that overlays ship for other projects' controllers: each group's CRDs, permissive, so that
# the API server stores the objects as it would with those projects installed.
FOREIGN = {
    "monitoring.coreos.com": ["ServiceMonitor", "PodMonitor", "PrometheusRule"],
    "cert-manager.io": ["Certificate", "Issuer"],
}


def _crd(group: str, kind: str) -> dict:
    plural = kind.lower() + "s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                 "versions": [{"name": "v1", "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {"type": "object",
                                                              "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


@pytest.fixture(scope="module")
def foreign_kinds(kubectl):
    for group, kinds in FOREIGN.items():
        for kind in kinds:
            kubectl.apply(json.dumps(_crd(group, kind)))
    for group, kinds in FOREIGN.items():
        for kind in kinds:
            kubectl.run("wait", "--for=condition=Established", f"crd/{kind.lower()}s.{group}", "--timeout=60s")


def test_base_applies(install, installed, kubectl):
    done = install["apply"]
    assert done.returncode == 0, f"kubectl apply -k deploy/base exited {done.returncode}:\n{done.stderr}"
    rendered = kubectl.run("kustomize", str(ROOT / "deploy" / "base")).stdout
    names = kubectl.run("get", "-f", "-", "-o", "name", input=rendered).stdout.split()
    assert "validatingadmissionpolicy.admissionregistration.k8s.io/gpushard-device-channels" in names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_applies(installed, kubectl, foreign_kinds, overlay):
    done = installed.apply(ROOT / "deploy" / "overlays" / overlay, "--dry-run=server")
    assert done.returncode == 0, f"kubectl apply -k deploy/overlays/{overlay} exited {done.returncode}:\n{done.stderr}"


def test_policies_type_check_clean(installed, kubectl):
    rendered = yaml.safe_load_all(kubectl.run("kustomize", str(ROOT / "deploy" / "base")).stdout)
    shipped = {d["metadata"]["name"] for d in rendered if d and d["kind"] == "ValidatingAdmissionPolicy"}

    def checked():
        items = kubectl.json("get", "validatingadmissionpolicies")["items"]
        ours = [p for p in items if p["metadata"]["name"] in shipped]
        done = all(p.get("status", {}).get("observedGeneration") == p["metadata"]["generation"] for p in ours)
        return ours if len(ours) == len(shipped) and done else None
    policies = components.wait_for("type checking of every gpushard policy", checked, timeout=90)
    warnings = {p["metadata"]["name"]: p["status"].get("typeChecking", {}).get("expressionWarnings", [])
                for p in policies}
    assert {n: w for n, w in warnings.items() if w} == {}


def test_server_side_takeover(install):
    taken = install["server-side apply"]
    assert taken.returncode == 0, f"kubectl apply --server-side -k deploy/base after kubectl apply:\n{taken.stderr}"
    diff = install["diff --server-side"]
    assert diff.returncode == 0, f"kubectl diff --server-side shows:\n{diff.stdout}\n{diff.stderr}"
