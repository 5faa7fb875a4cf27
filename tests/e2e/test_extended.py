"""We test DeviceClasses that serve an extended resource (DRAExtendedResource, beta and on by default in 1.36)
on a real kube-apiserver calling `gpushard serve`, which watches them with its own ServiceAccount's rights:
- the API server keeps a DeviceClass's spec.extendedResourceName, and accepts and refuses the same names as
  the cluster file's check (webhook.core.extended.name_problem);
- while another driver's class serves nvidia.com/gpu, a `nvidia.com/gpu: 0.25` pod in an enforce namespace is
  admitted rewritten into gpushard's shares, kubectl printing gpushard's warning;
- while one serves gpushard.io/gpu, such a pod and a Deployment are denied with gpushard's message naming the
  class, the field and the value, and a pod asking no GPU is admitted;
- `gpushard audit`, as a person bound to the shipped gpushard-auditor role, reports both classes;
- the classes are deleted at the end, and the webhook is seen to forget them (tests share one cluster).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e import components, gpushard, objects
from webhook.core import extended

ROOT = Path(__file__).resolve().parents[2]
# Before 1.36 DRAExtendedResource is alpha and off: the API server drops spec.extendedResourceName, so no
# DeviceClass serves a resource and there is nothing here to judge.
pytestmark = pytest.mark.kubernetes(36, "DeviceClass extendedResourceName needs 1.36 (DRAExtendedResource: "
                                        "alpha before, the API server drops it)")
NVIDIA = "gpu.nvidia.com"
TAKER = "gpu.example.com"
WARNING = ("Warning: gpushard: DeviceClass gpu.nvidia.com serves nvidia.com/gpu too; the fraction became "
           "gpushard.io/gpu shares")
DENIAL = ('admission webhook "enforce.gpushard.io" denied the request: gpushard: DeviceClass gpu.example.com has '
          "spec.extendedResourceName gpushard.io/gpu, a resource gpushard writes, so the scheduler would serve it "
          "with devices of driver gpu.example.com")


def device_class(name: str, resource: str) -> str:
    return json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
                       "spec": {"extendedResourceName": resource,
                                "selectors": [{"cel": {"expression": f'device.driver == "{name}"'}}]}})


class Classes:
    """The DeviceClasses a test wants, and a way to see when the webhook has seen them."""

    def __init__(self, kubectl: components.Kubectl, namespace: str, webhook):
        self.kubectl, self.namespace, self.webhook = kubectl, namespace, webhook
        self.made: set[str] = set()

    def put(self, name: str, resource: str) -> None:
        self.kubectl.apply(device_class(name, resource))
        self.made.add(name)

    def drop(self, name: str) -> None:
        self.kubectl.run("delete", "deviceclass", name, "--ignore-not-found", "--wait=false")

    def dry_run(self) -> subprocess.CompletedProcess:
        """A fraction pod created as a dry run in an enforce namespace: what admission says of it now."""
        return self.kubectl.run("apply", "--dry-run=server", "-n", self.namespace, "-f", "-", check=False,
                                input=objects.pod("probe", objects.container(gpu="0.25")))

    def wait_until(self, what: str, seen) -> None:
        components.wait_for(f"the webhook to see {what}", lambda: seen(self.dry_run()), timeout=30,
                            explain=self.webhook.tail)


@pytest.fixture(scope="module")
def classes(kubectl, installed):
    probe = "e2e-extended-probe"
    kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": probe, "labels": {"gpushard.io/mode": "enforce"}}}))
    made = Classes(kubectl, probe, installed)
    yield made
    for name in made.made:
        made.drop(name)
    # Left as found: the next tests' pods are judged without these classes.
    made.wait_until("the classes gone", lambda done: done.returncode == 0 and "DeviceClass" not in done.stderr)
    kubectl.run("delete", "namespace", probe, "--wait=false", check=False)


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "gpushard.io/card-3", "example.com/gpu.big_1",
                                      "gpu", "example.kubernetes.io/gpu", "kubernetes.io/gpu",
                                      "requests.example.com/gpu", "Example.com/gpu", "example.com/-gpu",
                                      "example.com/" + "g" * 64])
def test_the_api_server_keeps_extended_resource_name_and_checks_it_as_gpushard_does(installed, kubectl, resource):
    done = kubectl.run("create", "--dry-run=server", "-o", "json", "-f", "-", check=False,
                       input=device_class("e2e-name-check", resource))
    if extended.name_problem(resource) is None:
        assert done.returncode == 0, done.stderr
        # With DRAExtendedResource off the API server would drop the field instead.
        assert json.loads(done.stdout)["spec"]["extendedResourceName"] == resource
    else:
        # The words differ between the handwritten and the declarative validation; the field and verdict do not.
        assert done.returncode == 1, done.stdout
        assert "spec.extendedResourceName: Invalid value" in done.stderr, done.stderr


def test_a_fraction_is_rewritten_with_a_warning_while_another_driver_serves_nvidia_gpu(classes, kubectl, namespace):
    classes.drop(TAKER)
    classes.put(NVIDIA, "nvidia.com/gpu")
    classes.wait_until("gpu.nvidia.com", lambda done: done.returncode == 0 and WARNING in done.stderr)
    done = kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("quarter", objects.container(gpu="0.25")))
    assert WARNING in done.stderr.splitlines(), done.stderr
    pod = kubectl.json("get", "pod", "quarter", "-n", namespace)
    card = pod["metadata"]["annotations"]["gpushard.io/card"]
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"gpushard.io/gpu": "25",
                                                                   f"gpushard.io/card-{card}": "25"}


def test_pods_and_workloads_are_denied_while_another_driver_serves_gpushards_shares(classes, kubectl, namespace):
    classes.put(TAKER, "gpushard.io/gpu")
    classes.wait_until("gpu.example.com", lambda done: done.returncode == 1 and DENIAL in done.stderr)
    done = kubectl.run("apply", "-n", namespace, "-f", "-", check=False,
                       input=objects.pod("quarter", objects.container(gpu="0.25")))
    assert done.returncode == 1 and DENIAL in done.stderr, done.stderr
    assert "remove extendedResourceName from that class, or give gpushard other resource names in its config" in \
        done.stderr
    done = kubectl.run("apply", "-n", namespace, "-f", "-", check=False, input=objects.deployment("serve", "0.25"))
    assert done.returncode == 1 and DENIAL in done.stderr, done.stderr
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("web", objects.container()))


def test_audit_reports_the_classes(classes, plane, kubectl):
    classes.put(NVIDIA, "nvidia.com/gpu")
    classes.put(TAKER, "gpushard.io/gpu")
    kubectl.run("apply", "-f", str(ROOT / "examples" / "auditor-binding.yaml"))
    auditor = plane.user_config("extended-auditor", "e2e-auditor", ("gpu-admins",))
    done = subprocess.run([gpushard.GPUSHARD, "audit", "-o", "json", f"--kubeconfig={auditor}",
                           "--request-timeout=20s"], capture_output=True, text=True, timeout=90,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not audited" not in done.stderr, done.stderr
    rows = {(x["name"], x["rule"], x["severity"]) for x in json.loads(done.stdout)["findings"]
            if x["kind"] == "DeviceClass"}
    assert rows == {(NVIDIA, "extended-resource-shared", "warn"), (TAKER, "extended-resource-taken", "deny")}
