"""We test deploy/base as shipped, its pods running from gpushard's image on a real kubelet, containerd and runc:
- the certificate Job makes the Secret and the webhook configuration's CA; the webhook Deployment's pods turn
  Ready through their HTTPS readiness probe; the agent's DaemonSet pod registers every card with the kubelet;
- the security contexts hold in the running containers: the webhook runs as 65532 on a read-only root
  filesystem; the agent as root with no capability at all, its root filesystem read-only too;
- the API server calls the webhook through its Service (no loopback URL anywhere): a 0.25 pod in an enforce
  namespace is rewritten, bound, allocated by the agent's pod, and its container sees its card and no other;
  a pod asking 1.5 cards is denied with gpushard's message.
"""

from __future__ import annotations

from tests.e2e import gpushard, objects
from tests.runtime import seeing

SYSTEM = gpushard.SYSTEM


def pod_of(kubectl, component: str) -> str:
    pods = kubectl.json("get", "pods", "-n", SYSTEM, "-l", f"app.kubernetes.io/component={component}")["items"]
    running = [p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"]
    assert running, [p["status"] for p in pods]
    return running[0]


def python(kubectl, pod: str, code: str) -> str:
    return kubectl.run("exec", "-n", SYSTEM, pod, "--", "python3", "-c", code).stdout.strip()


def test_the_install_runs_as_pods(installed):
    kubectl = installed
    secret = kubectl.json("get", "secret", "gpushard-tls", "-n", SYSTEM)
    assert set(secret["data"]) >= {"tls.crt", "tls.key"}
    configuration = kubectl.json("get", "mutatingwebhookconfiguration", "gpushard")
    for hook in configuration["webhooks"]:
        assert "url" not in hook["clientConfig"], hook["clientConfig"]
        assert hook["clientConfig"]["service"]["name"] == "gpushard"
        assert hook["clientConfig"].get("caBundle"), hook["name"]
    webhook = kubectl.json("get", "deployment", "gpushard-webhook", "-n", SYSTEM)
    assert webhook["status"].get("readyReplicas") == webhook["spec"]["replicas"]
    agent = kubectl.json("get", "daemonset", "gpushard-agent", "-n", SYSTEM)
    assert agent["status"].get("numberReady") == 1


def test_security_contexts_hold_in_the_running_containers(installed):
    kubectl = installed
    webhook = pod_of(kubectl, "webhook")
    assert python(kubectl, webhook, "import os; print(os.getuid(), os.getgid())") == "65532 65532"
    refused = python(kubectl, webhook, "import os\ntry:\n open('/probe', 'w')\nexcept OSError as e:\n print(e.errno)")
    assert refused == "30", refused  # EROFS: the root filesystem is read-only
    agent = pod_of(kubectl, "agent")
    assert python(kubectl, agent, "import os; print(os.getuid())") == "0"
    caps = python(kubectl, agent,
                  "print([x.split()[1] for x in open('/proc/self/status') if x.startswith('CapEff')][0])")
    assert int(caps, 16) == 0, caps
    refused = python(kubectl, agent, "import os\ntry:\n open('/probe', 'w')\nexcept OSError as e:\n print(e.errno)")
    assert refused == "30", refused


def admits_rewrites_runs_and_denies(kubectl, runtime, namespace: str) -> None:
    """A 0.25 pod rewritten to one card's shares, bound, allocated by the agent's pod, seeing its card and no
    other; a pod asking 1.5 cards denied with gpushard's message. The same checks run on the Helm install
    (test_takeover.py)."""
    kubectl.apply(seeing.pod("quarter", seeing.container(gpu="0.25")), "-n", namespace)
    pod = kubectl.json("get", "pod", "quarter", "-n", namespace)
    card = int(pod["metadata"]["annotations"]["gpushard.io/card"])
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"gpushard.io/gpu": "25",
                                                                   f"gpushard.io/card-{card}": "25"}
    seeing.running(kubectl, namespace, "quarter", explain=runtime.tail)
    view = seeing.seen(kubectl, namespace, "quarter")
    seeing.expect_card(view, card, ("envvar", "volume-mounts", "cdi-cri"), runtime)
    denied = kubectl.run("apply", "-n", namespace, "-f", "-", check=False,
                         input=objects.pod("too-big", objects.container(gpu="1.5")))
    assert denied.returncode != 0 and "gpushard: container \"main\" asks nvidia.com/gpu 1500m" in denied.stderr, \
        denied.stderr


def test_the_api_server_calls_the_webhook_through_its_service(installed, runtime, namespace):
    admits_rewrites_runs_and_denies(installed, runtime, namespace)
