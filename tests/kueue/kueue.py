"""Kueue's manager on this machine, as the kueue tier runs it beside gpushard: its CRDs, its webhooks pointed
at it over loopback, and the queues the tests use.

Kueue's manager reads its metrics certificate from the fixed path /etc/kueue/metrics/certs whenever its own
certificate management is off (cmd/kueue/main.go of v0.17.0), which it must be here: its webhooks are served
on loopback with a certificate of the tier's CA. So the manager runs in a mount namespace of its own, with
an overlay on /etc whose upper layer is in the tier's folder: the machine's /etc is never written.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import urllib.request
from pathlib import Path

import yaml

from tests.e2e import components

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
# Namespaces the tier's webhooks and Kueue's pod integration reach: the tests' own, nothing of the system.
MANAGED_LABEL = "gpushard.io/kueue-e2e"
# The webhooks kept: Kueue's own kinds, batch Jobs and plain pods (the others serve integrations not installed).
KEPT = {"mclusterqueue.kb.io", "mresourceflavor.kb.io", "mworkload.kb.io", "mjob.kb.io", "mpod.kb.io",
        "vclusterqueue.kb.io", "vcohort.kb.io", "vresourceflavor.kb.io", "vworkload.kb.io", "vjob.kb.io",
        "vpod.kb.io"}
CARD_PREFIX = "gpushard.io/card-"
SHARES = "gpushard.io/gpu"
FLAVOR, CLUSTER_QUEUE, LOCAL_QUEUE = "gpushard", "gpus", "gpus"


def config(port: int, health: int, certs: Path) -> dict:
    """The manager's Configuration: webhooks on loopback with the tier's certificate, no leader election, the
    Job and pod integrations in the tests' namespaces, gpushard's per-card resources left out of quota."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"}, "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": port, "certDir": str(certs)},
        "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
        "managedJobsNamespaceSelector": {"matchLabels": {MANAGED_LABEL: "true"}},
        "integrations": {"frameworks": ["batch/job", "pod"]},
        "resources": {"excludeResourcePrefixes": [CARD_PREFIX]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def webhooks(manifests: Path, url: str, ca: Path) -> list[dict]:
    """Kueue's webhook configurations called at ``url`` with ``ca``: the kept webhooks, Jobs' and pods' only in
    the tests' namespaces."""
    bundle = base64.b64encode(ca.read_bytes()).decode()
    out = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc:
            continue
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        kept = []
        for hook in doc["webhooks"]:
            if hook["name"] not in KEPT:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url}{path}", "caBundle": bundle}
            if hook["name"] in ("mjob.kb.io", "mpod.kb.io", "vjob.kb.io", "vpod.kb.io"):
                hook["namespaceSelector"] = {"matchLabels": {MANAGED_LABEL: "true"}}
            kept.append(hook)
        doc["webhooks"] = kept
        out.append(doc)
    return out


def queues(quota: int) -> list[dict]:
    """One flavor, a ClusterQueue whose quota is ``quota`` shares of gpushard.io/gpu, and its LocalQueue made per
    namespace (``local_queue``)."""
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{
             "coveredResources": [SHARES],
             "flavors": [{"name": FLAVOR, "resources": [{"name": SHARES, "nominalQuota": quota}]}]}]}},
    ]


def local_queue(namespace: str) -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": LOCAL_QUEUE, "namespace": namespace}, "spec": {"clusterQueue": CLUSTER_QUEUE}}


class Kueue:
    """Kueue's manager (``folder``: e2e/build.py build --kueue) with its CRDs and webhooks, leader election off."""

    def __init__(self, folder: Path, plane: components.ControlPlane, work: Path):
        self.folder, self.plane, self.work = folder, plane, work
        self.home = work / "kueue"
        self.home.mkdir(exist_ok=True)
        self.port, self.health = components.free_port(), components.free_port()
        self.process: components.Process | None = None
        self.cert, self.key = plane.pki.issue("kueue", "kueue-webhook", dns=("localhost",), ips=("127.0.0.1",),
                                              server=True)

    def start(self) -> Kueue:
        kubectl = self.plane.kubectl
        crds = sorted((self.folder / "bases").glob("*.yaml"))
        for crd in crds:
            kubectl.run("apply", "--server-side", "-f", str(crd), timeout=120)
        kubectl.run("wait", "--for=condition=Established", "--timeout=90s", *(
            f"crd/{yaml.safe_load(c.read_text())['metadata']['name']}" for c in crds), timeout=120)
        certs = self.home / "certs"
        certs.mkdir(exist_ok=True)
        shutil.copy(self.cert, certs / "tls.crt")
        shutil.copy(self.key, certs / "tls.key")
        settings = self.home / "config.yaml"
        settings.write_text(yaml.safe_dump(config(self.port, self.health, certs)))
        upper, scratch = self.home / "etc-upper", self.home / "etc-work"
        upper.mkdir(exist_ok=True)
        scratch.mkdir(exist_ok=True)
        # In its own mount namespace: /etc overlaid (upper layer here), the metrics certificate where the manager
        # reads it, then the manager itself.
        script = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={scratch} /etc && "
                  f"mkdir -p /etc/kueue/metrics/certs && cp {certs}/tls.crt {certs}/tls.key /etc/kueue/metrics/certs/ "
                  f"&& exec {self.folder / 'kueue'} --config={settings} --kubeconfig={self.plane.admin_config()} "
                  "--zap-log-level=2")
        self.process = components.Process("kueue", ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                                    script], self.work / "kueue.log", env=dict(os.environ)).start()
        components.wait_for("Kueue's /readyz", self._ready, timeout=120, explain=self.tail)
        for doc in webhooks(self.folder / "manifests.yaml", f"https://127.0.0.1:{self.port}", self.plane.pki.ca_path):
            kubectl.apply(json.dumps(doc))
        return self

    def _ready(self) -> bool:
        if not self.process.alive():
            raise AssertionError(f"Kueue exited:\n{self.tail()}")
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.health}/readyz", timeout=3).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        # Its webhooks first: they fail closed, and pod creation would stop with the manager.
        self.plane.kubectl.run("delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration",
                               "kueue-mutating-webhook-configuration", "kueue-validating-webhook-configuration",
                               "--ignore-not-found", check=False)
        if self.process is not None:
            self.process.stop()

    def tail(self, lines: int = 40) -> str:
        return self.process.tail(lines) if self.process else ""
