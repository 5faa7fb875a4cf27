"""`gpushard status` with backend dra, against the local API server:
- cards come from gpushard's ResourceSlices (shares, model, uuid, memory), holders from the claims' allocation
  results (consumed shares), named by the pod the claim is reserved for;
- claims not yet allocated, and other drivers' claims and slices, count nothing; a card that left the slice
  (Unhealthy) keeps its holders visible with capacity 0;
- -l narrows the nodes by their labels; the table prints as with the device plugin.
"""

from __future__ import annotations

import json

import pytest

from tests import fakekube
from tests.agent import draworld
from tests.audit import world
from webhook import cli
from webhook.core import draobjects

H100 = "NVIDIA H100 80GB HBM3"


def card(k):
    return draobjects.CardFacts(k, f"GPU-{k}", H100, 81559)


def claim(namespace, pod, uid, node, device, shares, driver=draobjects.names.DRA_DRIVER):
    obj = draworld.claim(namespace, f"{pod}-gpushard-gpu-x1", uid, node, device, shares, driver=driver)
    obj["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": f"pod-{uid}"}]
    return obj


@pytest.fixture
def fake():
    with fakekube.FakeKube() as server:
        for name, labels in (("node-a", {"pool": "train"}), ("node-b", {"pool": "infer"})):
            server.put("nodes", {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": {}}})
        server.put("resourceslices", draobjects.resource_slice("node-a", [card(0), card(2)], 100, 1))  # 1 left
        server.put("resourceslices", draobjects.resource_slice("node-b", [card(0)], 100, 0))
        other = draobjects.resource_slice("node-b", [card(5)], 100, 0, driver="gpu.nvidia.com")
        server.put("resourceslices", other)
        server.put("resourceclaims", claim("ml", "train-a", "u1", "node-a", "card-0", 50))
        server.put("resourceclaims", claim("ml", "train-b", "u2", "node-a", "card-0", 25))
        server.put("resourceclaims", claim("lab", "notebook", "u3", "node-a", "card-1", 40))
        server.put("resourceclaims", claim("ml", "other", "u4", "node-b", "gpu-0", 1, driver="gpu.nvidia.com"))
        waiting = claim("ml", "waiting", "u5", "node-b", "card-0", 10)
        del waiting["status"]
        server.put("resourceclaims", waiting)
        yield server


@pytest.fixture
def argv(fake, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nbackend: dra\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(world.kubeconfig(fake))
    return ["--kubeconfig", str(kubeconfig), "--config", str(config)]


def test_status_reads_slices_and_claims(argv, capsys):
    assert cli.main(["status", *argv, "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    nodes = {n["name"]: n for n in report["nodes"]}
    assert list(nodes) == ["node-a", "node-b"]
    a = {c["index"]: c for c in nodes["node-a"]["cards"]}
    assert (a[0]["used"], a[0]["free"], a[0]["capacity"]) == (75, 25, 100)
    assert [(p["namespace"], p["name"], p["shares"]) for p in a[0]["pods"]] == [("ml", "train-a", 50),
                                                                                ("ml", "train-b", 25)]
    assert a[0]["model"] == H100 and a[0]["uuid"] == "GPU-0"
    assert (a[1]["capacity"], a[1]["used"]) == (0, 40)  # left the slice, still held
    assert a[2]["used"] == 0
    assert [c["index"] for c in nodes["node-b"]["cards"]] == [0] and nodes["node-b"]["used"] == 0
    assert report["totals"]["capacity"] == 300 and report["totals"]["used"] == 115
    assert report["pending"] == []


def test_the_selector_narrows_nodes(argv, capsys):
    assert cli.main(["status", *argv, "-o", "json", "-l", "pool=infer"]) == 0
    assert [n["name"] for n in json.loads(capsys.readouterr().out)["nodes"]] == ["node-b"]


def test_the_table(argv, capsys):
    assert cli.main(["status", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["NODE", "CARD", "MODEL", "USED"]
    assert any(line.startswith("node-a") and "ml/train-a" in line for line in lines)
