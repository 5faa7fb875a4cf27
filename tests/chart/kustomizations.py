"""deploy/'s kustomizations as `kubectl kustomize` renders them, and the chart values that stand for each."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.chart import helm
from tests.deploy import rendering

DEPLOY = helm.ROOT / "deploy"
# The values that render each kustomization.
VALUES: dict[str, dict] = {
    "base": {},
    "overlays/audit-only": {"mode": "audit-only"},
    "overlays/cert-manager": {"certs": {"mode": "cert-manager"}},
    "overlays/dra": {"backend": "dra", "config": {"replacement": {"enabled": False}}},
    "overlays/isolation-mps": {"isolation": "mps"},
    "overlays/monitoring": {"monitoring": {"enabled": True}},
    "overlays/network-policy": {"networkPolicy": {"enabled": True}},
}

# Operators' overlays that change what the chart sets with values (examples/, relative to the root).
EXAMPLES: dict[str, dict] = {
    "examples/device-policy": {"devicePolicy": {"exemptNamespaces": ["gpu-operator"],
                                                "exemptServiceAccounts": ["gpu-monitoring/dcgm-exporter"]}},
}


def kustomize(folder: Path) -> list[dict]:
    kubectl = helm.kubectl()
    if kubectl is None:
        return rendering.render(folder)
    done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
