"""We test the NetworkPolicies of deploy/overlays/network-policy, evaluated as Kubernetes defines them
(an ingress rule allows a peer that matches any of its `from` entries on any of its ports; a pod selected
by a policy with Ingress takes only what some rule allows):
- the overlay renders with the test renderer (and with kubectl where installed: tests/deploy/test_rendered.py);
- the webhook policy selects exactly the webhook's pods, and the agent policy exactly the agents';
- the API server (a control-plane node's address, or an address outside the cluster) and the
  konnectivity agents reach the webhook's port; a tenant's pod in any namespace does not, nor does any
  peer reach another port; Prometheus's namespace reaches the webhook's and the agents' metrics;
- the ports named are the ones the webhook and the agent listen on;
- docs/install.md shows how to apply it and names the ranges to set.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy import rendering

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy/overlays/network-policy"
POD_CIDR = "10.244.0.0/16"


@dataclass
class Peer:
    ip: str
    namespace: str | None = None  # None: not a pod (a node, the API server, outside the cluster)
    labels: dict = field(default_factory=dict)


def _selects(selector: dict | None, labels: dict) -> bool:
    if selector is None:
        return True
    assert set(selector) <= {"matchLabels"}, "the evaluator knows matchLabels only"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(entry: dict, peer: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in entry:
        block = entry["ipBlock"]
        ip = ipaddress.ip_address(peer.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if peer.namespace is None:
        return False  # selectors match pods only
    namespace_labels = {"kubernetes.io/metadata.name": peer.namespace}
    if "namespaceSelector" in entry:
        if not _selects(entry["namespaceSelector"], namespace_labels):
            return False
    elif peer.namespace != policy_namespace:
        return False
    return _selects(entry.get("podSelector"), peer.labels)


def allowed(policies: list[dict], pod_labels: dict, peer: Peer, port: int) -> bool:
    """Whether ingress from ``peer`` to ``port`` of a pod labelled ``pod_labels`` in gpushard-system is allowed."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod_labels)
                 and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports is not None and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP"
                                             for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_matches(e, peer, policy["metadata"]["namespace"]) for e in peers):
                return True
    return False


@pytest.fixture(scope="module")
def objects():
    return rendering.render(OVERLAY)


def _template_labels(objects, kind, name):
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj["spec"]["template"]["metadata"]["labels"], obj["spec"]["template"]["spec"]


def _policies(objects):
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


API_SERVER_ON_A_NODE = Peer("192.168.10.2")
API_SERVER_OUTSIDE = Peer("34.118.20.5")
KONNECTIVITY = Peer("10.244.0.9", "kube-system", {"k8s-app": "konnectivity-agent"})
PROMETHEUS = Peer("10.244.7.3", "monitoring", {"app.kubernetes.io/name": "prometheus"})
TENANTS = [Peer("10.244.3.7", "team-a", {"app": "train"}),
           Peer("10.244.3.8", "team-a", {"k8s-app": "konnectivity-agent"}),  # a tenant borrowing the label
           Peer("10.244.3.9", "team-b", {"app.kubernetes.io/name": "prometheus"}),
           Peer("10.244.4.1", "default")]


def test_the_webhook_port_takes_the_api_server_and_no_tenant_pod(objects):
    labels, spec = _template_labels(objects, "Deployment", "gpushard-webhook")
    (port,) = [p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])]
    policies = _policies(objects)
    for peer in (API_SERVER_ON_A_NODE, API_SERVER_OUTSIDE, KONNECTIVITY, PROMETHEUS):
        assert allowed(policies, labels, peer, port), peer
    for peer in TENANTS:
        assert not allowed(policies, labels, peer, port), peer
    for peer in (API_SERVER_ON_A_NODE, KONNECTIVITY, PROMETHEUS):
        assert not allowed(policies, labels, peer, port + 1), peer
    # The Service sends its port 443 to that same container port.
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "gpushard"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port]


def test_the_agents_metrics_take_only_prometheus_s_namespace(objects):
    labels, spec = _template_labels(objects, "DaemonSet", "gpushard-agent")
    (port,) = [p["containerPort"] for c in spec["containers"] for p in c.get("ports", []) if p["name"] == "metrics"]
    assert f"--metrics-port={port}" in spec["containers"][0]["args"]
    policies = _policies(objects)
    assert allowed(policies, labels, PROMETHEUS, port)
    for peer in (*TENANTS, KONNECTIVITY, API_SERVER_ON_A_NODE):
        assert not allowed(policies, labels, peer, port), peer


def test_each_policy_selects_only_its_own_pods(objects):
    policies = {p["metadata"]["name"]: p for p in _policies(objects)}
    assert set(policies) == {"gpushard-webhook", "gpushard-agent-metrics"}
    webhook, _ = _template_labels(objects, "Deployment", "gpushard-webhook")
    agent, _ = _template_labels(objects, "DaemonSet", "gpushard-agent")
    replacer, _ = _template_labels(objects, "Deployment", "gpushard-replacer")
    assert _selects(policies["gpushard-webhook"]["spec"]["podSelector"], webhook)
    assert not _selects(policies["gpushard-webhook"]["spec"]["podSelector"], agent)
    assert _selects(policies["gpushard-agent-metrics"]["spec"]["podSelector"], agent)
    for policy in policies.values():
        assert policy["metadata"]["namespace"] == "gpushard-system"
        assert not _selects(policy["spec"]["podSelector"], replacer)
        # The pod network's range is set in one place per policy that names addresses.
        for rule in policy["spec"]["ingress"]:
            for entry in rule["from"]:
                if "ipBlock" in entry:
                    assert entry["ipBlock"]["except"] == [POD_CIDR]


def test_the_install_guide_applies_it_and_names_what_to_set():
    text = (ROOT / "docs/install.md").read_text()
    section = text.split("### A NetworkPolicy for the webhook's port", 1)[1].split("\n## ", 1)[0]
    assert "kubectl apply -k deploy/overlays/network-policy" in section
    for needed in (POD_CIDR, "konnectivity", "monitoring", "8443", "kube-apiserver"):
        assert needed in section, needed
