"""The chart as an operator meets it: lint, versions, another namespace, the certificate modes, the labels
values add, and its `helm test` run against a real `gpushard serve`.

We test:
- `helm lint --strict` passes with the defaults and with every value set;
- Chart.yaml's version and appVersion are the package's, and kubeVersion the oldest Kubernetes
  docs/install.md supports; backend dra is refused, naming the cluster's version, before 1.36;
- installed into another namespace, nothing names gpushard-system: the Service reference, the webhooks'
  and policies' namespace selectors, the agent's username in the admission policies, the certificate's
  names, the params' namespace;
- certs.mode secret puts the CA into both webhooks' caBundle and the Secret into the webhook's volume, and
  makes neither the Job nor cert-manager's objects; certs.mode cert-manager annotates the webhook
  configuration for the CA injector;
- commonLabels and podLabels never reach a selector; the image digest replaces the tag; IPv6 pod
  ranges get an ipBlock of their own under ::/0;
- the helm test pod's script, run as the pod runs it against a real `gpushard serve` over TLS with the
  CA, passes for /mutate and /audit, and fails (exit 1, a `gpushard:` line) with a CA that did not sign
  the server's certificate; with the NetworkPolicy on it comes from its node's address.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

import webhook
from tests.admission import objects
from tests.chart import helm

helm.skip_module_without_helm()
pytestmark = pytest.mark.usefixtures("helm_binary")

EVERYTHING = yaml.safe_load((helm.ROOT / "tests/chart/values/good/everything.yaml").read_text())


def find(rendered: list[dict], kind: str, name: str) -> dict:
    return next(o for o in rendered if o["kind"] == kind and o["metadata"]["name"] == name)


def kinds(rendered: list[dict]) -> set[str]:
    return {o["kind"] for o in rendered}


@pytest.mark.parametrize("values", [None, EVERYTHING], ids=["defaults", "everything"])
def test_lint_strict_passes(values):
    done = helm.run("lint", "--strict", str(helm.CHART), values=values)
    assert "0 chart(s) failed" in done.stdout, done.stdout


def test_versions_follow_the_package_and_the_docs():
    chart = yaml.safe_load((helm.CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == chart["appVersion"] == webhook.__version__
    oldest = re.search(r"\*\*Kubernetes (1\.\d+) or newer\*\*", (helm.ROOT / "docs/install.md").read_text())
    assert oldest, "docs/install.md no longer says which Kubernetes it needs"
    assert chart["kubeVersion"] == f">={oldest.group(1)}.0-0"


def test_backend_dra_is_refused_before_kubernetes_1_36():
    for version in ("1.34.4", "1.35.0"):
        done = helm.run("template", helm.RELEASE, str(helm.CHART), "--kube-version", version,
                        values={"backend": "dra"}, check=False)
        assert done.returncode != 0
        assert (f"backend: dra needs Kubernetes 1.36 or newer (consumable capacity and DRA device health are alpha "
                f"and off before it); this cluster is v{version}") in done.stderr, done.stderr
        # The device plugin backend installs there.
        helm.run("template", helm.RELEASE, str(helm.CHART), "--kube-version", version)
    helm.run("template", helm.RELEASE, str(helm.CHART), "--kube-version", "1.36.0", values={"backend": "dra"})


def test_another_namespace_is_named_everywhere():
    text = helm._template("{}", "gpu-system")
    assert "gpushard-system" not in text
    rendered = helm.template(namespace="gpu-system")
    config = find(rendered, "MutatingWebhookConfiguration", "gpushard")
    for hook in config["webhooks"]:
        assert hook["clientConfig"]["service"]["namespace"] == "gpu-system"
        assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["gpu-system"]} in \
            hook["namespaceSelector"]["matchExpressions"]
    own_node = find(rendered, "ValidatingAdmissionPolicy", "gpushard-agent-own-node")
    assert own_node["spec"]["matchConditions"][0]["expression"] == \
        'request.userInfo.username == "system:serviceaccount:gpu-system:gpushard-agent"'
    channels = find(rendered, "ValidatingAdmissionPolicy", "gpushard-device-channels")
    assert "gpu-system" in channels["spec"]["matchConstraints"]["namespaceSelector"]["matchExpressions"][0]["values"]
    job = find(rendered, "Job", "gpushard-certs")
    assert "--namespace=gpu-system" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    namespaced = [o for o in rendered if "namespace" in o["metadata"]]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"gpu-system"}


def test_certs_from_a_secret():
    rendered = helm.template({"certs": {"mode": "secret", "secret": {"name": "my-tls", "caBundle": "Q0E="}}})
    config = find(rendered, "MutatingWebhookConfiguration", "gpushard")
    assert [hook["clientConfig"].get("caBundle") for hook in config["webhooks"]] == ["Q0E="] * 3
    volumes = find(rendered, "Deployment", "gpushard-webhook")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "my-tls", "defaultMode": 0o440}} in volumes
    assert not kinds(rendered) & {"Job", "CronJob", "Certificate", "Issuer"}
    assert not [o for o in rendered if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "certs"]
    test_pod = next(o for o in rendered if helm.is_test_hook(o))
    env = {e["name"]: e["value"] for e in test_pod["spec"]["containers"][0]["env"]}
    assert env["GPUSHARD_CA_BUNDLE"] == "Q0E=" and "GPUSHARD_CA" not in env


def test_certs_from_cert_manager():
    rendered = helm.template({"certs": {"mode": "cert-manager"}}, namespace="gpu-system")
    config = find(rendered, "MutatingWebhookConfiguration", "gpushard")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "gpu-system/gpushard-serving"
    assert find(rendered, "Certificate", "gpushard-serving")["spec"]["dnsNames"][0] == "gpushard.gpu-system.svc"
    assert not kinds(rendered) & {"Job", "CronJob"}


def test_ipv6_pod_ranges_go_under_their_own_block():
    policy = find(helm.template(EVERYTHING), "NetworkPolicy", "gpushard-webhook")
    assert policy["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/14"]}},
                                                    {"ipBlock": {"cidr": "::/0", "except": ["fd00::/48"]}}]


def test_values_labels_never_reach_selectors_and_digest_wins():
    rendered = helm.template(EVERYTHING)
    webhook_ = find(rendered, "Deployment", "gpushard-webhook")
    assert webhook_["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "gpushard",
                                                           "app.kubernetes.io/component": "webhook"}
    assert webhook_["spec"]["template"]["metadata"]["labels"]["team"] == "gpu"
    assert webhook_["metadata"]["labels"]["team"] == "gpu"
    assert webhook_["metadata"]["annotations"]["owner"] == "gpu-team"
    service = find(rendered, "Service", "gpushard")
    assert service["spec"]["selector"] == webhook_["spec"]["selector"]["matchLabels"]
    image = webhook_["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.example.com/gpushard@" + EVERYTHING["image"]["digest"]
    assert webhook_["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


# --- the helm test pod, run against a real server -----------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return objects.make_certs(tmp_path_factory.mktemp("certs") / "bundle")


@pytest.fixture(scope="module")
def server(certs, tmp_path_factory):
    cluster = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    cluster.write_text(objects.CLUSTER_YAML)
    srv = objects.Server(certs, cluster)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def review_pod(values: dict | None = None) -> dict:
    return next(o for o in helm.template(values) if helm.is_test_hook(o))


def run_test_pod(pod: dict, server: objects.Server, ca) -> subprocess.CompletedProcess:
    """The pod's container as the kubelet would start it, with this Python; it dials the local server."""
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python3", "-c"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["GPUSHARD_CA"] == "/etc/gpushard/ca/ca.crt"
    env.update(GPUSHARD_CA=str(ca), GPUSHARD_DIAL=f"127.0.0.1:{server.port}")
    return subprocess.run([sys.executable, "-c", *container["args"]], env=env, capture_output=True, text=True,
                          timeout=60)




def test_helm_test_pod_passes_against_the_webhook(server, certs):
    pod = review_pod()
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    done = run_test_pod(pod, server, certs / "ca.crt")
    assert done.returncode == 0, done.stderr
    assert "admitted the pod as gpushard.io/gpu 50 of one card" in done.stdout


def test_helm_test_pod_in_audit_only_mode(server, certs):
    pod = review_pod({"mode": "audit-only"})
    done = run_test_pod(pod, server, certs / "ca.crt")
    assert done.returncode == 0, done.stderr
    assert "/audit admitted the pod unchanged" in done.stdout


def test_helm_test_pod_fails_with_another_ca(server, tmp_path):
    other = objects.make_certs(tmp_path / "other")
    done = run_test_pod(review_pod(), server, other / "ca.crt")
    assert done.returncode == 1
    assert done.stderr.startswith("gpushard: helm test failed: cannot reach https://gpushard.gpushard-system.svc")
    assert "CERTIFICATE_VERIFY_FAILED" in done.stderr


def test_helm_test_pod_uses_the_node_network_under_the_network_policy():
    assert "hostNetwork" not in review_pod()["spec"]
    spec = review_pod({"networkPolicy": {"enabled": True}})["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
