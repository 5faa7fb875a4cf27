"""We test admission through a real kube-apiserver calling `gpushard serve`, as kubectl shows it to a user:
- in an enforce namespace a fraction becomes shares of one card with the card's env, a container that asked
  for nothing gets `void`, and a pod past one card is denied with gpushard's message as kubectl prints it;
- in an audit namespace nothing changes and each finding is a `Warning:` line of kubectl's;
- annotations that make a runtime inject devices, and device-list mounts, are denied by the API server's own
  policy in every namespace, opted in or not; gpushard's resources are refused outside enforce namespaces;
- workloads: a Deployment's template gets integer shares, and each pod its ReplicaSet makes gets its card;
- a ResourceQuota on gpushard.io/gpu counts the shares the rewrite wrote;
- a debug container gets `void` with each of `kubectl debug`'s profiles (the default one included), but
  sysadmin's, which is privileged and denied;
- with the webhook down, enforce namespaces fail closed for GPU pods (a pod asking for nothing is admitted
  unrewritten there), and every other namespace goes on as before;
- the webhook's log holds no traceback and no ERROR line after all of it, a connection that sent nothing
  past the read deadline included.
"""

from __future__ import annotations

import json
import socket
import ssl

import pytest

from tests.e2e import components, objects

AUDIT = pytest.mark.parametrize("namespace", ["audit"], indirect=True)
PLAIN = pytest.mark.parametrize("namespace", [None], indirect=True)


def get(kubectl, namespace: str, kind: str, name: str) -> dict:
    return kubectl.json("get", kind, name, "-n", namespace)


def refused(done, *phrases: str) -> None:
    """kubectl exited 1 and printed each phrase (the whole output is the failure's text)."""
    text = f"kubectl exited {done.returncode}:\n{done.stdout}{done.stderr}"
    assert done.returncode == 1, text
    for phrase in phrases:
        assert phrase in done.stderr, text


def test_fraction_becomes_shares_of_one_card(installed, kubectl, namespace):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
        "quarter", objects.container(gpu="0.25"), objects.container("sidecar")))
    pod = get(kubectl, namespace, "pod", "quarter")
    card = pod["metadata"]["annotations"]["gpushard.io/card"]
    main, sidecar = pod["spec"]["containers"]
    want = {"gpushard.io/gpu": "25", f"gpushard.io/card-{card}": "25"}
    assert main["resources"]["limits"] == want and main["resources"]["requests"] == want
    assert objects.env_of(main)["NVIDIA_VISIBLE_DEVICES"] == card
    assert objects.env_of(main)["GPUSHARD_FRACTION"] == "0.25"
    assert objects.env_of(sidecar)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert pod["metadata"]["annotations"]["gpushard.io/shares"] == "25"
    assert pod["metadata"]["labels"]["gpushard.io/shared"] == "true"


def test_pod_past_one_card_denied_as_kubectl_prints_it(installed, kubectl, namespace):
    done = kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
        "too-much", objects.container(gpu="1.5")), check=False)
    # The API server hands admission the canonical quantity, so the message quotes 1500m for 1.5.
    refused(done, 'admission webhook "enforce.gpushard.io" denied the request: gpushard: container "main"',
            "asks nvidia.com/gpu 1500m")
    assert kubectl.run("get", "pod", "too-much", "-n", namespace, check=False).returncode == 1


@AUDIT
def test_audit_namespace_warns_and_changes_nothing(installed, kubectl, namespace):
    done = kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(
        "two-cards", objects.container(gpu="2")))
    warnings = [line for line in done.stderr.splitlines() if line.startswith("Warning: gpushard:")]
    assert warnings, done.stderr
    pod = get(kubectl, namespace, "pod", "two-cards")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert "gpushard.io/card" not in pod["metadata"].get("annotations", {})


@pytest.mark.parametrize("namespace", [None, "enforce", "audit"], indirect=True)
def test_injecting_annotation_denied_in_every_namespace(installed, kubectl, namespace):
    done = kubectl.run("apply", "-n", namespace, "-f", "-", check=False, input=objects.pod(
        "inject", annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}))
    if namespace.startswith("e2e-") and kubectl.json("get", "namespace", namespace)["metadata"]["labels"].get(
            "gpushard.io/mode") == "enforce":
        # Mutating admission runs first: in enforce namespaces the webhook denies before the policy is asked.
        refused(done, 'admission webhook "enforce.gpushard.io" denied the request: gpushard: annotation '
                '"cdi.k8s.io/gpu"')
    else:
        refused(done, "ValidatingAdmissionPolicy 'gpushard-device-channels'",
                'gpushard: annotation "cdi.k8s.io/gpu" makes the container runtime')


@PLAIN
def test_device_list_mount_denied_outside_enforce(installed, kubectl, namespace):
    c = objects.container()
    c["volumeMounts"] = [{"name": "all", "mountPath": "/var/run/nvidia-container-devices/all"}]
    done = kubectl.run("apply", "-n", namespace, "-f", "-", check=False, input=objects.pod(
        "mount", c, volumes=[{"name": "all", "hostPath": {"path": "/dev/null"}}]))
    refused(done, 'gpushard: container "main" mounts a volume under /var/run/nvidia-container-devices')


@PLAIN
def test_shares_refused_outside_enforce(installed, kubectl, namespace):
    done = kubectl.run("apply", "-n", namespace, "-f", "-", check=False, input=objects.pod(
        "sneaky", objects.container(gpu="10", resource="gpushard.io/card-0")))
    refused(done, "ValidatingAdmissionPolicy 'gpushard-opt-in'", 'gpushard: container "main" asks gpushard.io/*',
            "label the namespace gpushard.io/mode=enforce")


@PLAIN
def test_plain_namespace_untouched(installed, kubectl, namespace):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("plain", objects.container(gpu="1")))
    pod = get(kubectl, namespace, "pod", "plain")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert "env" not in pod["spec"]["containers"][0]


def test_workload_template_and_its_pods(installed, kubectl, namespace):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.deployment("serve", "0.25", replicas=2))
    template = get(kubectl, namespace, "deployment", "serve")["spec"]["template"]
    assert template["spec"]["containers"][0]["resources"]["limits"] == {"gpushard.io/gpu": "25"}

    def pods():
        items = kubectl.json("get", "pods", "-n", namespace, "-l", "app=serve")["items"]
        return items if len(items) == 2 else None
    for pod in components.wait_for("the Deployment's two pods", pods, timeout=60):
        card = pod["metadata"]["annotations"]["gpushard.io/card"]
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"gpushard.io/gpu": "25", f"gpushard.io/card-{card}": "25"}
        assert objects.env_of(pod["spec"]["containers"][0])["NVIDIA_VISIBLE_DEVICES"] == card


def test_quota_counts_shares(installed, kubectl, namespace):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.quota("gpus", {"requests.gpushard.io/gpu": "50"}))
    components.wait_for("the quota's status", lambda: get(kubectl, namespace, "resourcequota", "gpus").get(
        "status", {}).get("hard"), timeout=30)
    for name in ("q1", "q2"):
        kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod(name, objects.container(gpu="0.25")))
    done = kubectl.run("apply", "-n", namespace, "-f", "-", check=False,
                       input=objects.pod("q3", objects.container(gpu="0.25")))
    refused(done, "exceeded quota: gpus", "requested: requests.gpushard.io/gpu=25")


@pytest.mark.parametrize("profile", ["general", "baseline", "restricted", "netadmin", "sysadmin", None])
def test_debug_container_per_kubectl_profile(installed, kubectl, namespace, profile):
    # None: kubectl's own default (general since 1.36).
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("target", objects.container(gpu="0.25")))
    chosen = [f"--profile={profile}"] if profile else []
    done = kubectl.run("debug", "target", "-n", namespace, "--image=registry.example/debug:1", "--container=dbg",
                       "--target=main", *chosen, "--", "sleep", "1", check=False)
    if profile == "sysadmin":
        refused(done, 'gpushard: ephemeral container "dbg" is privileged', "would see every card of the node")
        assert not get(kubectl, namespace, "pod", "target")["spec"].get("ephemeralContainers")
        return
    assert done.returncode == 0, done.stderr
    debug = get(kubectl, namespace, "pod", "target")["spec"]["ephemeralContainers"]
    assert [objects.env_of(c).get("NVIDIA_VISIBLE_DEVICES") for c in debug] == ["void"]


@pytest.fixture
def namespaces(kubectl):
    made = []
    for mode in ("enforce", "audit", None):
        name = f"e2e-down-{mode or 'plain'}"
        labels = {"gpushard.io/mode": mode} if mode else {}
        kubectl.apply(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                  "metadata": {"name": name, "labels": labels}}))
        made.append(name)
    yield dict(zip(("enforce", "audit", "plain"), made, strict=True))
    for name in made:
        kubectl.run("delete", "namespace", name, "--wait=false", check=False)


def test_webhook_down_fails_closed_only_where_opted_in(installed, kubectl, namespaces):
    installed.stop()
    try:
        down = kubectl.run("apply", "-n", namespaces["enforce"], "-f", "-", check=False,
                              input=objects.pod("while-down", objects.container(gpu="0.25")))
        refused(down, 'failed calling webhook "enforce.gpushard.io"')
        # A pod asking no GPU is the hide entry's (failurePolicy Ignore): admitted as written.
        kubectl.run("apply", "-n", namespaces["enforce"], "-f", "-", input=objects.pod(
            "plain-while-down", objects.container()))
        plain = get(kubectl, namespaces["enforce"], "pod", "plain-while-down")
        assert "NVIDIA_VISIBLE_DEVICES" not in objects.env_of(plain["spec"]["containers"][0])
        for mode in ("audit", "plain"):
            kubectl.run("apply", "-n", namespaces[mode], "-f", "-", input=objects.pod(
                "while-down", objects.container(gpu="1")))
    finally:
        installed.restart()
    kubectl.run("apply", "-n", namespaces["enforce"], "-f", "-",
                input=objects.pod("after", objects.container(gpu="0.25")))


def test_webhook_log_has_no_traceback(installed, plane):
    # The API server's connection pool (and a balancer's TLS health check) opens connections that send no
    # request: hold one open past the webhook's read deadline (10 s) beside everything this run sent.
    context = ssl.create_default_context(cafile=str(plane.pki.ca_path))
    with socket.create_connection(("127.0.0.1", installed.port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.settimeout(15)
            assert tls.recv(1) == b""  # the webhook closes it at its deadline
    log = installed.log()
    assert "Traceback" not in log, installed.tail(60)
    assert "[ERROR]" not in log, installed.tail(60)
