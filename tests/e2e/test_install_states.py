"""We test, on a real kube-apiserver (a control plane of its own, so the install of the other tests is untouched), the
states an install, upgrade or removal can leave (docs/operations.md, "States of the install"), walked in order:
- installed, the webhook answering: a plain pod is created in an enforce namespace and in one that did not opt in;
  a pod with a device annotation is refused in the one that did not opt in;
- the webhook process stopped: in the enforce namespace a plain pod is still created (the hide entry is
  skipped) and a GPU pod refused; elsewhere nothing changes;
- a plain pod made again from the manifest of one gpushard hid (``NVIDIA_VISIBLE_DEVICES=void``, as `kubectl get -o
  yaml` shows it), while the webhook is stopped: created (what the webhook writes sends nothing to the Fail entry);
- an exemption added by an operator's overlay (examples/device-policy) lets the device pod through in the trusted
  namespace; the policy's binding deleted (its last) and the base applied again, the exemption is gone on the next
  request; the overlay applied again, it is back; the API server's watch of params (which a binding's removal can
  stop for good: kubernetes/kubernetes#133827) plays no part, since no policy reads params;
- a binding without its policy, and a policy without its binding: plain pods are created; `gpushard status`
  names the state and what to run; applying the base again finishes it;
- an upgrade from a version whose device-channel policy read a ConfigMap: with that ConfigMap missing every pod
  of every non-system namespace is refused (the state this version removes), `gpushard status` names it, and
  `kubectl apply -k deploy/base` over it drops paramKind and paramRef, after which plain pods are created again;
- gpushard-system deleted while the cluster-scoped objects stay, and the base applied again while it still
  terminates: plain pods are created throughout, the device pod stays refused; once the namespace is gone, the
  same apply finishes the install.
Pods are never scheduled here (no kubelet): admission is what is tested.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e import components, gpushard, objects
from tests.e2e.conftest import ASSETS

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "base"
EXEMPTIONS = ROOT / "examples" / "device-policy"
SYSTEM = gpushard.SYSTEM
DEVICE = {"cdi.k8s.io/e2e": "nvidia.com/gpu=all"}
_names = itertools.count()


@pytest.fixture(scope="module")
def cluster(work):
    yield from components.own_plane(ASSETS, work / "states")


def namespace(kubectl: components.Kubectl, name: str, mode: str | None = None) -> str:
    labels = {"gpushard.io/mode": mode} if mode else {}
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}))
    return name


@pytest.fixture(scope="module")
def spaces(cluster):
    kubectl = cluster.kubectl
    return {"enforce": namespace(kubectl, "states-enforce", "enforce"), "plain": namespace(kubectl, "states-plain"),
            "trusted": namespace(kubectl, "gpu-operator")}


@pytest.fixture(scope="module")
def webhook(cluster, work):
    done = cluster.kubectl.run("apply", "-k", str(BASE), check=False, timeout=180)
    assert done.returncode == 0, done.stderr
    hook = gpushard.Webhook(cluster, work / "states").start()
    yield hook
    hook.stop()


def create(kubectl: components.Kubectl, where: str, gpu: str | None = None,
           annotations: dict | None = None) -> subprocess.CompletedProcess:
    pod = objects.pod(f"p{next(_names)}", objects.container(gpu=gpu), annotations=annotations)
    return kubectl.run("create", "-n", where, "-f", "-", input=pod, check=False)


def admitted(kubectl: components.Kubectl, where: str, **kwargs) -> None:
    # Policy and binding changes reach the API server's admission through its informers: give them a moment.
    components.wait_for(f"a pod {kwargs or 'asking nothing'} admitted in {where}",
                        lambda: create(kubectl, where, **kwargs).returncode == 0, timeout=30,
                        explain=lambda: create(kubectl, where, **kwargs).stderr)


def refused(kubectl: components.Kubectl, where: str, phrase: str = "", **kwargs) -> None:
    def check():
        done = create(kubectl, where, **kwargs)
        return done.returncode != 0 and phrase in done.stderr
    components.wait_for(f"a pod {kwargs or 'asking nothing'} refused in {where}", check, timeout=30,
                        explain=lambda: create(kubectl, where, **kwargs).stderr)


def states(plane: components.ControlPlane) -> dict[tuple[str, str], str]:
    """(rule, object) -> what to run, as `gpushard status -o json` tells the install's states."""
    done = subprocess.run([gpushard.GPUSHARD, "status", f"--kubeconfig={plane.kubectl.config}", "-o", "json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {(s["rule"], s["name"]): s["run"] for s in json.loads(done.stdout)["install"]}


def test_installed_and_answering(cluster, spaces, webhook):
    kubectl = cluster.kubectl
    admitted(kubectl, spaces["enforce"])
    admitted(kubectl, spaces["plain"])
    refused(kubectl, spaces["plain"], "gpushard-device-channels", annotations=DEVICE)
    assert states(cluster) == {}


def test_the_webhook_stopped(cluster, spaces, webhook):
    kubectl = cluster.kubectl
    webhook.stop()
    try:
        admitted(kubectl, spaces["enforce"])
        refused(kubectl, spaces["enforce"], 'failed calling webhook "enforce.gpushard.io"', gpu="0.25")
        admitted(kubectl, spaces["plain"])
        refused(kubectl, spaces["plain"], "gpushard-device-channels", annotations=DEVICE)
    finally:
        webhook.restart()
    admitted(kubectl, spaces["enforce"], gpu="0.25")


def test_a_pod_made_again_from_a_hidden_pods_manifest(cluster, spaces, webhook):
    kubectl = cluster.kubectl
    where = spaces["enforce"]
    made = kubectl.run("create", "-n", where, "-o", "json", "-f", "-", input=objects.pod("hidden-once"))
    spec = json.loads(made.stdout)["spec"]
    assert objects.env_of(spec["containers"][0]) == {"NVIDIA_VISIBLE_DEVICES": "void"}
    # The API server's own additions (the token volume's mount) left out, as a manifest written again would.
    containers = [{k: v for k, v in c.items() if k != "volumeMounts"} for c in spec["containers"]]
    again = objects.pod("made-again", *containers)
    webhook.stop()
    try:
        done = kubectl.run("create", "-n", where, "-f", "-", input=again, check=False)
        assert done.returncode == 0, done.stderr
    finally:
        webhook.restart()


def test_an_exemption_follows_every_apply(cluster, spaces, webhook):
    kubectl = cluster.kubectl
    assert webhook.apply(EXEMPTIONS).returncode == 0
    admitted(kubectl, spaces["trusted"], annotations=DEVICE)
    refused(kubectl, spaces["plain"], "gpushard-device-channels", annotations=DEVICE)
    # The policy's last binding gone: for a policy with a built-in paramKind the API server could stop
    # watching its params here for good.
    kubectl.run("delete", "validatingadmissionpolicybinding", "gpushard-device-channels")
    assert webhook.apply(BASE).returncode == 0
    refused(kubectl, spaces["trusted"], "gpushard-device-channels", annotations=DEVICE)  # removed: enforced
    assert webhook.apply(EXEMPTIONS).returncode == 0
    admitted(kubectl, spaces["trusted"], annotations=DEVICE)  # added again: honoured
    assert webhook.apply(BASE).returncode == 0
    refused(kubectl, spaces["trusted"], "gpushard-device-channels", annotations=DEVICE)


def test_half_applied_policies(cluster, spaces, webhook):
    kubectl = cluster.kubectl
    kubectl.run("delete", "validatingadmissionpolicy", "gpushard-device-channels")
    admitted(kubectl, spaces["plain"])
    run = states(cluster)[("binding-without-policy", "gpushard-device-channels")]
    assert "kubectl apply -k deploy/base" in run
    assert webhook.apply(BASE).returncode == 0
    kubectl.run("delete", "validatingadmissionpolicybinding", "gpushard-device-claims")
    admitted(kubectl, spaces["enforce"])
    assert ("policy-without-binding", "gpushard-device-claims") in states(cluster)
    assert webhook.apply(BASE).returncode == 0
    assert states(cluster) == {}
    refused(kubectl, spaces["plain"], "gpushard-device-channels", annotations=DEVICE)


def _earlier_version(kubectl: components.Kubectl) -> str:
    """gpushard-device-channels and its binding as a version that read its lists from a ConfigMap had them."""
    rendered = [d for d in yaml.safe_load_all(kubectl.run("kustomize", str(BASE)).stdout) if d]
    policy = next(d for d in rendered if d["kind"] == "ValidatingAdmissionPolicy"
                  and d["metadata"]["name"] == "gpushard-device-channels")
    binding = next(d for d in rendered if d["kind"] == "ValidatingAdmissionPolicyBinding"
                   and d["metadata"]["name"] == "gpushard-device-channels")
    policy["spec"]["paramKind"] = {"apiVersion": "v1", "kind": "ConfigMap"}
    del policy["spec"]["matchConditions"]
    for variable in policy["spec"]["variables"]:
        key = {"trustedNamespaces": "exemptNamespaces", "trustedServiceAccounts": "exemptServiceAccounts"}.get(
            variable["name"])
        if key:
            variable["expression"] = f"has(params.data) && '{key}' in params.data ? string(params.data.{key}) : ''"
    binding["spec"]["paramRef"] = {"name": "gpushard-device-policy", "namespace": SYSTEM,
                                   "parameterNotFoundAction": "Deny"}
    return yaml.safe_dump_all([policy, binding])


def test_an_upgrade_from_a_version_that_read_params(cluster, spaces, webhook):
    kubectl = cluster.kubectl
    kubectl.run("apply", "-f", "-", input=_earlier_version(kubectl))
    # Without its ConfigMap the policy of before refused every pod it matched, plain ones too.
    refused(kubectl, spaces["plain"], "gpushard-device-channels")
    found = states(cluster)
    assert ("policy-params", "gpushard-device-channels") in found
    assert webhook.apply(BASE).returncode == 0
    policy = kubectl.json("get", "validatingadmissionpolicy", "gpushard-device-channels")
    binding = kubectl.json("get", "validatingadmissionpolicybinding", "gpushard-device-channels")
    assert "paramKind" not in policy["spec"] and "paramRef" not in binding["spec"]
    admitted(kubectl, spaces["plain"])
    refused(kubectl, spaces["plain"], "gpushard-device-channels", annotations=DEVICE)
    assert states(cluster) == {}


def test_the_namespace_deleted_and_reinstalled_while_it_terminates(cluster, spaces, webhook, work):
    kubectl = cluster.kubectl
    webhook.stop()  # its token is its ServiceAccount's, which goes with the namespace
    kubectl.run("delete", "namespace", SYSTEM, "--wait=false")
    again = kubectl.run("apply", "-k", str(BASE), check=False, timeout=180)
    if again.returncode != 0:
        # The namespace still terminates: the cluster-scoped objects are applied, the namespaced ones refused.
        assert "being terminated" in again.stderr, again.stderr
    for where in spaces.values():
        admitted(kubectl, where)
    refused(kubectl, spaces["enforce"], 'failed calling webhook "enforce.gpushard.io"', gpu="0.25")
    refused(kubectl, spaces["plain"], "gpushard-device-channels", annotations=DEVICE)
    kubectl.run("wait", "--for=delete", f"namespace/{SYSTEM}", "--timeout=180s", check=False, timeout=200)
    done = kubectl.run("apply", "-k", str(BASE), check=False, timeout=180)
    assert done.returncode == 0, done.stderr
    (work / "states-again").mkdir()
    restarted = gpushard.Webhook(cluster, work / "states-again").start()
    try:
        admitted(kubectl, spaces["enforce"], gpu="0.25")
        assert states(cluster) == {}
    finally:
        restarted.stop()
