"""The monitoring overlay (deploy/overlays/monitoring): the Prometheus operator's monitors and the dashboard.

The operator's CRDs are not installed here, so we test the rendered objects' shape and that they
agree with the pods they scrape:
- kustomize itself (when kubectl is on the path) and the test renderer give the same objects;
- the PodMonitor selects exactly the agent DaemonSet's pods, on its named metrics port, keeping the
  workload's namespace/pod/container labels (honorLabels), over TLS with the token of an account bound
  to exactly the rights the agent and the webhook check (get nodes/metrics, get /metrics);
- the ServiceMonitor selects the webhook Service, on a port that reaches the webhook's HTTPS port,
  verifying TLS with the CA of the Secret the certs Job writes, for the name the certificate is made for,
  with the same account's token;
- the dashboard ConfigMap carries the Grafana sidecar's label and the dashboard JSON; every metric
  its panels query is one that the agent or the webhook exports, and every panel has a query; it
  has panels for admissions, denials and errors, latency, view sync and the agents' health; the
  webhook's per-replica gauges are taken once per card (max by), never summed over replicas, and
  per-node queries follow the node variable;
- the alert rules (a PrometheusRule) query only exported metrics, among them the agent's
  PodResources health.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import rendering
from webhook import cli

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy/overlays/monitoring"
NAMESPACE = "gpushard-system"


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return rendering.render(OVERLAY)


def _find(objects, kind, name=None):
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)}"
    return hits[0]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_what_the_test_renderer_renders(objects):
    text = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], check=True, capture_output=True, text=True,
                          timeout=120).stdout
    rendered = [d for d in yaml.safe_load_all(text) if d]
    ident = sorted((o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in rendered)
    assert ident == sorted((o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objects)
    dashboard = _find(rendered, "ConfigMap", "gpushard-dashboard")
    assert json.loads(dashboard["data"]["gpushard.json"]) == json.loads((OVERLAY / "dashboard.json").read_text())


def test_the_pod_monitor_scrapes_every_agent_on_its_metrics_port(objects):
    monitor = _find(objects, "PodMonitor", "gpushard-agent")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    pods = [o for o in objects if o["kind"] in ("DaemonSet", "Deployment", "Job", "CronJob")
            and _selects(monitor["spec"]["selector"], rendering.pod_template_labels(o))]
    assert [(o["kind"], o["metadata"]["name"]) for o in pods] == [("DaemonSet", "gpushard-agent")]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    container = pods[0]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[endpoint["port"]] == cli.build_parser().parse_args(container["args"]).metrics_port
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True


def test_the_pod_monitor_scrapes_over_tls_with_a_token_allowed_what_the_agent_checks(objects):
    from webhook import authorizing

    (endpoint,) = _find(objects, "PodMonitor", "gpushard-agent")["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}  # the agent's certificate is made at its start
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer" and credentials["key"] == "token"
    secret = _find(objects, "Secret", credentials["name"])
    assert secret["metadata"]["namespace"] == NAMESPACE and secret["type"] == "kubernetes.io/service-account-token"
    account = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    _find(objects, "ServiceAccount", account)
    bindings = [b for b in objects if b["kind"] == "ClusterRoleBinding"
                and {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in b["subjects"]]
    rules = [r for b in bindings for r in _find(objects, "ClusterRole", b["roleRef"]["name"])["rules"]]
    wanted = authorizing.node_metrics("n").attributes["resourceAttributes"]
    url = authorizing.METRICS_URL.attributes["nonResourceAttributes"]
    assert rules == [{"apiGroups": [wanted["group"]], "resources": [f"{wanted['resource']}/{wanted['subresource']}"],
                      "verbs": [wanted["verb"]]}, {"nonResourceURLs": [url["path"]], "verbs": [url["verb"]]}]


def test_the_service_monitor_scrapes_the_webhook_over_verified_tls(objects):
    monitor = _find(objects, "ServiceMonitor", "gpushard-webhook")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    services = [o for o in objects if o["kind"] == "Service"
                and _selects(monitor["spec"]["selector"], o["metadata"].get("labels") or {})]
    assert [s["metadata"]["name"] for s in services] == ["gpushard"]
    service = services[0]
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    webhook = _find(objects, "Deployment", "gpushard-webhook")["spec"]["template"]["spec"]["containers"][0]
    bind = cli.build_parser().parse_args(webhook["args"]).bind
    assert str(port["targetPort"]) == bind.rpartition(":")[2]
    assert _selects({"matchLabels": service["spec"]["selector"]},
                    _find(objects, "Deployment", "gpushard-webhook")["spec"]["template"]["metadata"]["labels"])
    assert (endpoint["scheme"], endpoint["path"]) == ("https", "/metrics")
    job = _find(objects, "Job", "gpushard-certs")["spec"]["template"]["spec"]["containers"][0]
    certs = cli.build_parser().parse_args(job["args"])
    tls = endpoint["tlsConfig"]
    assert tls["serverName"] == f"{certs.service}.{certs.namespace}.svc"
    assert tls["ca"] == {"secret": {"name": certs.secret, "key": "ca.crt"}}
    assert "insecureSkipVerify" not in tls
    agent = _find(objects, "PodMonitor", "gpushard-agent")["spec"]["podMetricsEndpoints"][0]
    assert endpoint["authorization"] == agent["authorization"]


def _exported_metric_names() -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    from webhook.admission import metrics
    from webhook.agent.metrics import exporting
    from webhook.agent.node import nvml

    card = nvml.Card(0, "GPU-0", "m", 1024)
    row = exporting.CardRow(card, True, True, nvml.Usage(0, 1024 * nvml.MIB, 1, process_utilization=True), containers=[
        exporting.ContainerRow("ns", "p", "c", 10, 100, 100)])
    text = exporting.text(exporting.new_registry(lambda: exporting.Observation("n", 100, [row], True)))
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    source = (ROOT / "webhook/admission/metrics.py").read_text()
    names |= set(re.findall(r'"(gpushard_[a-z_]+)"', source))
    names |= {n + suffix for n in names for suffix in ("_total", "_bucket", "_count", "_sum")}
    assert "gpushard_view_free_shares" in names and hasattr(metrics, "StateCollector")
    return names


def test_the_dashboard_queries_only_what_gpushard_exports(objects):
    config_map = _find(objects, "ConfigMap", "gpushard-dashboard")
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["gpushard.json"])
    assert dashboard["uid"] and dashboard["title"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 8
    exported = _exported_metric_names()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\bgpushard_[a-z_]+", target["expr"]))
            assert used and used <= exported, f"{panel['title']}: {sorted(used - exported)}"
    titles = {p["title"] for p in panels}
    assert {"Card memory used", "GPU memory by container", "Containers above their share", "Admissions by outcome",
            "Denials and errors", "Admission latency", "View sync", "Agent: kubelet PodResources reachable"} <= titles


def test_the_webhook_row_counts_each_card_once_and_follows_the_node_variable(objects):
    dashboard = json.loads(_find(objects, "ConfigMap", "gpushard-dashboard")["data"]["gpushard.json"])
    exprs = [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    # Each webhook replica exports its own view: a plain sum would count every card once per replica.
    for expr in (e for e in exprs if "gpushard_view_" in e):
        assert re.search(r"(max|min|avg) by \([^)]*\) \(gpushard_view_", expr) or expr.startswith(
            "sum by (resource) (rate("), expr
    free = next(e for e in exprs if "gpushard_view_free_shares" in e)
    assert free == 'sum by (node) (max by (node, gpu) (gpushard_view_free_shares{node=~"$node"}))'
    # Per-node series of the agents and the view take the node variable.
    for expr in (e for e in exprs if re.search(r"gpushard_(card|container|agent|view_free)_", e)):
        assert 'node=~"$node"' in expr, expr


def test_the_alert_rules_query_only_what_gpushard_exports(objects):
    rules = _find(objects, "PrometheusRule", "gpushard")
    assert rules["metadata"]["namespace"] == NAMESPACE
    alerts = {r["alert"]: r for g in rules["spec"]["groups"] for r in g["rules"]}
    exported = _exported_metric_names()
    for name, rule in alerts.items():
        used = set(re.findall(r"\bgpushard_[a-z_]+", rule["expr"]))
        assert used and used <= exported, f"{name}: {sorted(used - exported)}"
        assert rule["annotations"]["summary"] and rule["labels"]["severity"]
    # A kubelet the agent cannot reach is an alert of its own: its shares are unknown, not 0.
    assert "gpushard_agent_podresources_up" in alerts["GpushardKubeletPodResourcesUnreachable"]["expr"]
