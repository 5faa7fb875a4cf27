"""`gpushard status` and `gpushard top` show a cordoned card, against the local API server (tests/fakekube.py).

We test:
- the status table marks the card `(cordoned)`, counts no free shares on it while its pods still count
  as used, and says who cordoned it, when, why and how many pods are still on it; cards of other nodes
  and uncordoned cards print as before;
- `-o json` carries each card's cordon ({reason, by, at}, or null) and no free shares for it;
- a pod waiting on a card cordoned on every node, while another card has room, is told as stranded;
- with backend dra, where the cordoned card has left the slice, status still lists it (capacity 0) with
  its holders and its cordon, read from the Node;
- `gpushard top` shows the card's HEALTH as `Healthy, cordoned` from the agent's gpushard_card_cordoned,
  and `cordoned: true` in JSON;
- the webhook's metrics count each node's cordoned cards (gpushard_view_cordoned_cards).
"""

from __future__ import annotations

import json

import pytest

from tests import fakekube
from tests.agent import draworld
from tests.audit import world
from tests.test_top import agent_pod, card, row, top
from tests.test_top import kube as kube  # noqa: F401 - the fixture, for the top test
from webhook import cli
from webhook.admission import metrics
from webhook.cluster import static
from webhook.core import draobjects, names, objects

H100 = "NVIDIA H100 80GB HBM3"
CORDON = objects.Cordon("fan replacement", "alice@example.com", "2026-03-01T10:00:00Z")


def cordon(node: dict, *indexes: int) -> dict:
    node["metadata"]["annotations"].update({names.card_cordon_annotation(k): objects.write_cordon(CORDON)
                                            for k in indexes})
    return node


@pytest.fixture
def fake():
    with fakekube.FakeKube() as server:
        server.put("nodes", cordon(world.shared_node("gpu-a", 2, H100), 1))
        server.put("nodes", world.shared_node("gpu-b", 2, H100))
        server.put("pods", world.pod("ml", "on-cordoned", [world.pinned("main", 1, 30)], node="gpu-a", card=1,
                                     shares=30))
        server.put("pods", world.pod("ml", "other", [world.pinned("main", 0, 50)], node="gpu-a", card=0, shares=50))
        yield server


@pytest.fixture
def kubeconfig(fake, tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(world.kubeconfig(fake))
    return str(path)


def test_the_status_table_marks_the_cordoned_card_and_says_who_and_why(kubeconfig, capsys):
    assert cli.main(["status", "--kubeconfig", kubeconfig]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:3]): line.split() for line in lines if line.startswith("gpu-")}
    assert rows[("gpu-a", "0", "NVIDIA")][6:9] == ["50", "50", "100"]
    # Cordoned: its 30 shares still used, none free, its capacity as the node says.
    assert rows[("gpu-a", "1", "(cordoned)")][7:11] == ["30", "0", "100", "30%"]
    assert rows[("gpu-a", "all", "80")] == ["gpu-a", "all", "80", "50", "200", "40%", "2", "pods"]
    assert rows[("gpu-b", "1", "NVIDIA")][6:9] == ["0", "100", "100"]
    assert lines[-1] == ("cordoned: card 1 of gpu-a (by alice@example.com at 2026-03-01T10:00:00Z: fan replacement), "
                         "1 pod still on it")


def test_status_json_carries_each_card_s_cordon(kubeconfig, capsys):
    assert cli.main(["status", "--kubeconfig", kubeconfig, "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    a = next(n for n in doc["nodes"] if n["name"] == "gpu-a")
    c0, c1 = a["cards"]
    assert c0["cordoned"] is None and c0["free"] == 50
    assert c1["cordoned"] == CORDON.as_json() and (c1["used"], c1["free"], c1["capacity"]) == (30, 0, 100)
    assert a["free"] == 50 and doc["totals"]["free"] == 50 + 200


def test_a_pod_waiting_on_a_card_cordoned_everywhere_is_stranded(fake, kubeconfig, capsys):
    fake.put("nodes", cordon(world.shared_node("gpu-b", 2, H100), 1))
    waiting = world.pod("ml", "waiting", [world.pinned("main", 1, 40)], card=1, shares=40)
    waiting["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "web", "controller": True}]
    fake.put("pods", waiting)
    assert cli.main(["status", "--kubeconfig", kubeconfig]) == 0
    out = capsys.readouterr().out
    assert "stranded: ml/waiting waits on full card 1 while another card has room: gpushard replace evicts it" in out
    assert "cordoned: card 1 of gpu-b (" in out and "0 pods still on it" in out


def test_with_backend_dra_the_cordoned_card_shows_though_it_left_the_slice(fake, kubeconfig, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nbackend: dra\n")
    facts = [draobjects.CardFacts(0, "GPU-gpu-a-0", H100, 81559)]  # card 1 cordoned: left the slice
    fake.put("resourceslices", draobjects.resource_slice("gpu-a", facts, 100, 1))
    on_it = draworld.claim("ml", "on-cordoned-claim", "u1", "gpu-a", "card-1", 30)
    on_it["status"]["reservedFor"] = [{"resource": "pods", "name": "on-cordoned", "uid": "pod-u1"}]
    fake.put("resourceclaims", on_it)
    assert cli.main(["status", "--kubeconfig", kubeconfig, "--config", str(config), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    a = next(n for n in doc["nodes"] if n["name"] == "gpu-a")
    c1 = next(c for c in a["cards"] if c["index"] == 1)
    assert (c1["capacity"], c1["used"], c1["free"]) == (0, 30, 0)
    assert c1["cordoned"] == CORDON.as_json() and [p["name"] for p in c1["pods"]] == ["on-cordoned"]
    assert next(c for c in a["cards"] if c["index"] == 0)["cordoned"] is None


def test_top_shows_the_cordoned_card(kube, capsys):  # noqa: F811 - the fixture imported above
    kube.put("pods", agent_pod("agent-a", "node-a"))
    cordoned = card(1, 1024, 12, row("lab", "batch", "worker", 40, 1024))
    cordoned.cordoned = True
    kube.serve_agent("agent-a", "node-a", [card(0, 0, 0), cordoned])
    status, out, err = top(kube, capsys, "cards")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[1].split()[-1] == "Healthy"
    assert lines[2].split()[-2:] == ["Healthy,", "cordoned"]
    status, out, _err = top(kube, capsys, "cards", "-o", "json")
    assert [c["cordoned"] for c in json.loads(out)["cards"]] == [False, True]


def test_the_webhook_counts_each_node_s_cordoned_cards():
    view = static.StaticView(static.parse({"nodes": [
        {"name": "a", "cards": [{"index": 0, "cordoned": True}, {"index": 1, "cordoned": True, "usedShares": 10}]},
        {"name": "b", "cards": [{"index": 0}]}]}, 100))
    reg = metrics.prometheus_client.CollectorRegistry(auto_describe=False)
    reg.register(metrics.StateCollector(view))
    text = metrics.prometheus_client.generate_latest(reg).decode()
    assert 'gpushard_view_cordoned_cards{node="a"} 2.0' in text
    assert 'gpushard_view_cordoned_cards{node="b"}' not in text
    assert 'gpushard_view_free_shares{gpu="1",node="a"} 0.0' in text
    assert 'gpushard_view_shares{state="free"} 100.0' in text  # only card 0 of b
