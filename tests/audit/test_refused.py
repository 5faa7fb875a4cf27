"""We test that `gpushard status` names the GPU pods the kubelet refused at admission (after a node reboot, before the
agent registered: docs/operations.md), over the fake API server:
- a refused pod of a ReplicaSet is named with its controller, which makes it again; a bare refused pod is named
  with what to do, since nothing makes it again;
- pods refused for what asked no gpushard resource, pods failed for another reason and running pods are not
  named; the list follows -n and the node selector; `-o json` carries the same under "refused";
- only failed pods are asked for (fieldSelector status.phase=Failed); the pods that come back are checked again.
"""

from __future__ import annotations

import json

import pytest

from tests import fakekube
from tests.audit import world
from webhook import cli

MESSAGE = ("Pod was rejected: Allocate failed due to no healthy devices present; cannot allocate unhealthy devices "
           "gpushard.io/card-1, which is unexpected")


def refused(ns: str, name: str, limits: dict, owner: str | None = None, reason: str = "UnexpectedAdmissionError",
            node: str = "gpu-2x") -> dict:
    made = world.pod(ns, name, [world.container("main", limits)], node, "Failed")
    made["status"].update({"reason": reason, "message": MESSAGE})
    if owner:
        made["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                                                "uid": "u-1", "controller": True}]
    return made


@pytest.fixture
def kubeconfig(tmp_path):
    with fakekube.FakeKube() as fake:
        world.populate(fake)
        for pod in (refused("ml", "train-7d9-x", {"gpushard.io/gpu": "50", "gpushard.io/card-1": "50"}, "train-7d9"),
                    refused("ml", "bare", {"gpushard.io/gpu": "25", "gpushard.io/card-0": "25"}),
                    refused("lab", "whole", {"nvidia.com/gpu": "1"}),
                    refused("lab", "evicted", {"gpushard.io/gpu": "25", "gpushard.io/card-0": "25"}, reason="Evicted"),
                    refused("ml", "elsewhere", {"gpushard.io/gpu": "10", "gpushard.io/card-2": "10"}, node="gpu-8x")):
            fake.put("pods", pod)
        path = tmp_path / "kubeconfig"
        path.write_text(world.kubeconfig(fake))
        yield str(path), fake


def test_status_names_the_refused_gpu_pods_and_what_brings_each_back(kubeconfig, capsys):
    path, fake = kubeconfig
    assert cli.main(["status", "--kubeconfig", path]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("refused:")]
    assert lines == [
        f"refused: ml/bare on gpu-2x by the kubelet (UnexpectedAdmissionError: {MESSAGE}): a bare pod: nothing makes "
        "it again; delete this one, then create it again from its own manifest (not from kubectl get -o yaml: that "
        "one is pinned to the old card and node)",
        f"refused: ml/train-7d9-x on gpu-2x by the kubelet (UnexpectedAdmissionError: {MESSAGE}): its controller "
        "ReplicaSet/train-7d9 makes a new pod; delete this one once read",
        f"refused: ml/elsewhere on gpu-8x by the kubelet (UnexpectedAdmissionError: {MESSAGE}): a bare pod: nothing "
        "makes it again; delete this one, then create it again from its own manifest (not from kubectl get -o yaml: "
        "that one is pinned to the old card and node)",
    ]
    asked = [q for method, q, _ in fake.requests if method == "GET" and "fieldSelector=status.phase%3DFailed" in q]
    assert len(asked) == 1, asked


def test_json_namespace_and_selector_narrow_the_list(kubeconfig, capsys):
    path, _ = kubeconfig
    assert cli.main(["status", "--kubeconfig", path, "-o", "json", "-n", "ml", "-l",
                     "kubernetes.io/hostname=gpu-2x"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["namespace"], p["name"], p["controller"]) for p in report["refused"]] == [
        ("ml", "bare", None), ("ml", "train-7d9-x", "ReplicaSet/train-7d9")]
    assert report["refused"][0]["node"] == "gpu-2x" and report["refused"][0]["message"] == MESSAGE[:200]
    assert cli.main(["status", "--kubeconfig", path, "-n", "lab"]) == 0
    assert "refused:" not in capsys.readouterr().out
