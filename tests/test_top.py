"""We test `gpushard top` against the local Kubernetes API server, which port-forwards to the agents
(GET /api/v1/namespaces/<ns>/pods/<agent>/portforward?ports=<port>, WebSocket) where real agent metrics
servers (webhook.agent.metrics.exporting.Server: TLS, tokens reviewed) answer on local ports:
- the agents take the port-forward (their loopback) without any token, so top works for whoever the
  API server lets port-forward, whatever credentials they hold; top never uses the pod proxy;
- it finds the running agent pods by label and their named metrics port;
- the card table (shares held of capacity, memory used of total, utilization, health) and the pod table
  (shares, memory used, memory share, the pod's memory ask where it was placed by one, cap, utilization
  where reported, OVER for a container above its share), node by node;
- an agent that does not answer is named on stderr and the others still show; none answering,
  or no agent at all, is exit status 3 (the cluster lacks what top reads) with a message; JSON and
  YAML output, --no-headers; filters by node and namespace;
- the metrics text `gpushard top` reads is the agent's own exposition (webhook.agent.metrics.exporting);
- an agent that cannot reach the kubelet's PodResources shows its cards' shares as unknown ("?",
  "kubelet unreachable", null in JSON), with a note, never as 0; a proxy that times out is told in
  plain words; -o json|yaml carries apiVersion, kind and camelCase keys like status and audit.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

import pytest
import yaml

from tests.fakekube import FakeKube, SilentServer
from webhook import cli
from webhook.agent.metrics import exporting
from webhook.agent.node import nvml

MIB = nvml.MIB
NS = "gpushard-system"


def card(index: int, used_mib: int, util: int, *containers: exporting.ContainerRow, healthy: bool = True):
    c = nvml.Card(index, f"GPU-{index}", "NVIDIA L4", 16384)
    usage = nvml.Usage(used_mib * MIB, 16384 * MIB, util, process_utilization=index == 0)
    return exporting.CardRow(c, healthy, True, usage, shares_allocated=sum(r.shares for r in containers),
                             containers=list(containers))


def row(ns: str, pod: str, container: str, shares: int, used_mib: int, cap: bool = False, sm: float = 0.0,
        asked_mib: int | None = None):
    share = shares * 16384 * MIB // 100
    return exporting.ContainerRow(ns, pod, container, shares, share, share if cap else None, used_mib * MIB, 1, sm,
                                  None if asked_mib is None else asked_mib * MIB)


def agent_pod(name: str, node: str, port: int = 9401, phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "namespace": NS,
                         "labels": {"app.kubernetes.io/name": "gpushard", "app.kubernetes.io/component": "agent"}},
            "spec": {"nodeName": node, "containers": [{"name": "agent", "ports": [
                {"name": "metrics", "containerPort": port}]}]},
            "status": {"phase": phase}}


@pytest.fixture
def kube(tmp_path):
    servers = []

    def serve(name: str, node: str, rows: list[exporting.CardRow], port: int = 9401, up: bool = True) -> None:
        """A real agent metrics server on a local port, which the fake API server port-forwards to;
        ``up`` False: its kubelet's PodResources does not answer."""
        observation = exporting.Observation(node, 100, rows, pod_resources_up=up)
        server = exporting.Server(exporting.new_registry(lambda: observation), 0, addr="127.0.0.1")
        servers.append(server)
        fake.forwards[(NS, name, port)] = ("127.0.0.1", server.port)

    with FakeKube() as fake:
        fake.serve_agent = serve
        config = tmp_path / "kubeconfig"
        config.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        fake.kubeconfig = str(config)
        yield fake
    for server in servers:
        server.close()


def top(kube, capsys, *args: str) -> tuple[int, str, str]:
    status = cli.main(["top", *args, "--kubeconfig", kube.kubeconfig])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_top_reads_every_agent_through_a_port_forward(kube, capsys):
    kube.put("pods", agent_pod("agent-a", "node-a"))
    kube.put("pods", agent_pod("agent-b", "node-b", port=9500))
    kube.put("pods", agent_pod("agent-c", "node-c", phase="Pending"))
    kube.put("pods", {**agent_pod("unrelated", "node-a"), "metadata": {"name": "unrelated", "namespace": NS}})
    kube.serve_agent("agent-a", "node-a", [
        card(0, 6548, 87, row("ml", "train", "trainer", 25, 4500, sm=52),
             row("ml", "infer", "server", 50, 2048, sm=35, asked_mib=6144)),
        card(1, 1024, 12, row("lab", "batch", "worker", 40, 1024, cap=True), healthy=False)])
    kube.serve_agent("agent-b", "node-b", [card(0, 0, 0, row("lab", "notebook", "jupyter", 30, 0))], port=9500)

    status, out, err = top(kube, capsys)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "MODEL", "SHARES", "MEMORY", "UTIL", "UNATTRIBUTED", "HEALTH"]
    assert lines[1].split() == ["node-a", "0", "NVIDIA", "L4", "75/100", "6548Mi/16384Mi", "87%", "0Mi", "Healthy"]
    assert lines[2].split() == ["node-a", "1", "NVIDIA", "L4", "40/100", "1024Mi/16384Mi", "12%", "0Mi", "Unhealthy"]
    assert lines[3].split()[:5] == ["node-b", "0", "NVIDIA", "L4", "30/100"]
    pods = [line.split() for line in lines[5:]]
    assert pods[0] == ["NAMESPACE", "POD", "CONTAINER", "NODE", "GPU", "SHARES", "MEMORY", "MEMORY-SHARE", "ASKED",
                       "CAP", "UTIL"]
    assert ["ml", "train", "trainer", "node-a", "0", "25", "4500Mi", "4096Mi", "-", "-", "52%", "OVER"] in pods
    # Placed by its memory ask of 6 GiB, it got 50 shares (8 GiB of an L4).
    assert ["ml", "infer", "server", "node-a", "0", "50", "2048Mi", "8192Mi", "6144Mi", "-", "35%"] in pods
    # Card 1 reports no per-process utilization.
    assert ["lab", "batch", "worker", "node-a", "1", "40", "1024Mi", "6554Mi", "-", "6554Mi", "-"] in pods
    assert ["lab", "notebook", "jupyter", "node-b", "0", "30", "0Mi", "4915Mi", "-", "-", "0%"] in pods
    forwarded = [unquote(p) for m, p, _ in kube.requests if "/portforward" in p]
    assert sorted(forwarded) == [f"/api/v1/namespaces/{NS}/pods/agent-a/portforward?ports=9401",
                                 f"/api/v1/namespaces/{NS}/pods/agent-b/portforward?ports=9500"]
    assert not [p for m, p, _ in kube.requests if "/proxy" in p]

    status, out, _ = top(kube, capsys, "pods", "-n", "lab", "--sort-by", "shares", "-o", "json")
    body = json.loads(out)
    assert list(body) == ["apiVersion", "kind", "pods", "kubeletUnreachable"]
    assert (body["apiVersion"], body["kind"], body["kubeletUnreachable"]) == ("gpushard.io/v1", "TopReport", [])
    assert [(p["pod"], p["shares"]) for p in body["pods"]] == [("batch", 40), ("notebook", 30)]
    assert body["pods"][0]["memoryCapBytes"] == 16384 * MIB * 40 // 100
    assert body["pods"][0]["memoryAskedBytes"] is None
    assert set(body["pods"][0]) == {"node", "namespace", "pod", "container", "gpu", "shares", "memoryUsedBytes",
                                    "memoryShareBytes", "memoryCapBytes", "memoryAskedBytes", "utilization",
                                    "overShare"}

    status, out, _ = top(kube, capsys, "cards", "--node", "node-b")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["node-b"]
    status, out, _ = top(kube, capsys, "cards", "--node", "node-b", "--no-headers")
    assert [line.split()[0] for line in out.splitlines()] == ["node-b"]
    status, out, _ = top(kube, capsys, "pods", "-n", "ml", "-o", "yaml")
    assert status == 0 and sorted(p["pod"] for p in yaml.safe_load(out)["pods"]) == ["infer", "train"]
    status, out, _ = top(kube, capsys, "pods", "-n", "ml", "-o", "json")
    assert {p["pod"]: p["memoryAskedBytes"] for p in json.loads(out)["pods"]} == {"infer": 6144 * MIB, "train": None}


def test_an_agent_away_is_named_and_the_others_shown(kube, capsys):
    kube.put("pods", agent_pod("agent-a", "node-a"))
    kube.put("pods", agent_pod("agent-b", "node-b"))
    kube.serve_agent("agent-a", "node-a", [card(0, 10, 1)])
    status, out, err = top(kube, capsys, "cards")
    assert status == 0
    assert "node-a" in out and "node-b" not in out
    assert err == ("gpushard: cannot read the metrics of agent agent-b on node 'node-b': port-forward failed: "
                   "error forwarding port 9401 to pod agent-b: connection refused; read its log "
                   "(kubectl -n gpushard-system logs agent-b)\n")


def test_a_kubelet_the_agent_cannot_reach_shows_as_unknown_not_zero(kube, capsys):
    kube.put("pods", agent_pod("agent-a", "node-a"))
    kube.put("pods", agent_pod("agent-b", "node-b"))
    kube.serve_agent("agent-a", "node-a", [card(0, 6548, 87)], up=False)
    kube.serve_agent("agent-b", "node-b", [card(0, 10, 1)])
    status, out, err = top(kube, capsys)
    assert status == 0
    lines = out.splitlines()
    assert lines[1].split() == ["node-a", "0", "NVIDIA", "L4", "?/100", "6548Mi/16384Mi", "87%", "-", "Healthy,",
                                "kubelet", "unreachable"]
    assert lines[2].split()[:5] == ["node-b", "0", "NVIDIA", "L4", "0/100"]
    assert "No containers hold shares" not in out
    assert err == ("gpushard: the agent on node 'node-a' cannot reach the kubelet's PodResources API: who holds "
                   "shares there is unknown (not 0); see its log, and the kubelet's pod-resources socket\n")
    status, out, _ = top(kube, capsys, "cards", "-o", "json")
    body = json.loads(out)
    assert body["kubeletUnreachable"] == ["node-a"]
    assert [(c["node"], c["shares"], c["kubeletReachable"]) for c in body["cards"]] == [
        ("node-a", None, False), ("node-b", 0, True)]


def test_an_agent_that_never_answers_is_told_plainly(kube, capsys):
    kube.put("pods", agent_pod("agent-a", "node-a"))
    kube.put("pods", agent_pod("agent-b", "node-b"))
    with SilentServer() as silent:
        kube.forwards[(NS, "agent-a", 9401)] = ("127.0.0.1", int(silent.url.rsplit(":", 1)[1]))
        kube.serve_agent("agent-b", "node-b", [card(0, 10, 1)])
        status, out, err = top(kube, capsys, "cards", "--request-timeout", "1s")
    assert status == 0 and "node-b" in out
    assert err == ("gpushard: cannot read the metrics of agent agent-a on node 'node-a': no answer within 1s "
                   "through the port-forward; read its log (kubectl -n gpushard-system logs agent-a)\n")


def test_pods_default_to_the_contexts_namespace(kube, capsys, tmp_path):
    kube.put("pods", agent_pod("agent-a", "node-a"))
    kube.serve_agent("agent-a", "node-a", [card(0, 10, 1, row("ml", "train", "trainer", 25, 100),
                                                row("lab", "notebook", "jupyter", 30, 0))])
    config = json.loads(open(kube.kubeconfig).read())
    config["contexts"][0]["context"]["namespace"] = "lab"
    path = tmp_path / "lab-kubeconfig"
    path.write_text(json.dumps(config))
    status = cli.main(["top", "pods", "-o", "json", "--kubeconfig", str(path)])
    assert status == 0 and [p["pod"] for p in json.loads(capsys.readouterr().out)["pods"]] == ["notebook"]
    cli.main(["top", "pods", "-A", "-o", "json", "--kubeconfig", str(path)])
    assert sorted(p["pod"] for p in json.loads(capsys.readouterr().out)["pods"]) == ["notebook", "train"]


def test_no_agent_or_none_answering(kube, capsys):
    status, out, err = top(kube, capsys)
    assert (status, out) == (3, "")
    assert err.startswith("gpushard: no running agent in namespace 'gpushard-system'")
    kube.put("pods", agent_pod("agent-a", "node-a"))
    status, out, err = top(kube, capsys)
    assert status == 3
    assert "gpushard: no agent answered" in err
    status, _, err = cli.main(["top", "--kubeconfig", "/nonexistent/kubeconfig"]), None, capsys.readouterr().err
    assert status == 2 and err.startswith('gpushard: --kubeconfig "/nonexistent/kubeconfig": no such file')
