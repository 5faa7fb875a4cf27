"""We test that `gpushard status` names the nodes still coming up (an autoscaler's new node: docs/autoscaling.md),
over the fake API server:
- a node with gpushard's startup taint is named, with the cards its allocatable lists so far; another startup
  taint (another component's) is not gpushard's to name;
- a shared node whose allocatable lists fewer card resources than its gpushard.io/cards label (a NodePool's
  label, before the kubelet registered the agent) is named, under the device-plugin backend only;
- nodes that are up are not named; `-o json` carries the same under "starting"; the node selector narrows it.
"""

from __future__ import annotations

import json

import pytest

from tests import fakekube
from tests.audit import world
from webhook import cli
from webhook.core import auditing, names
from webhook.core import policy as policy_mod


def new_node(name: str, listed: int, taints: list[str]) -> dict:
    made = world.shared_node(name, 8, world.H100)
    allocatable = {k: v for k, v in made["status"]["allocatable"].items()
                   if not k.startswith("gpushard.io/card-") or int(k.rsplit("-", 1)[1]) < listed}
    made["status"]["allocatable"] = made["status"]["capacity"] = allocatable
    made["spec"] = {"taints": [{"key": key, "effect": "NoSchedule"} for key in taints]}
    return made


@pytest.fixture
def kubeconfig(tmp_path):
    with fakekube.FakeKube() as fake:
        world.populate(fake)
        fake.put("nodes", new_node("new-tainted", 0, [names.STARTUP_TAINT]))
        fake.put("nodes", new_node("new-short", 3, []))
        fake.put("nodes", new_node("other-startup", 8, ["startup-taint.cluster-autoscaler.kubernetes.io/cni"]))
        path = tmp_path / "kubeconfig"
        path.write_text(world.kubeconfig(fake))
        yield str(path)


def test_status_names_the_nodes_coming_up(kubeconfig, capsys):
    assert cli.main(["status", "--kubeconfig", kubeconfig]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("starting:")]
    assert lines == [
        'starting: node "new-short" is starting: its allocatable lists 3 of its 8 cards; pods wait until the '
        "kubelet registers gpushard's agent there (if it stays, read that agent's log)",
        f'starting: node "new-tainted" is starting: it keeps the startup taint {names.STARTUP_TAINT} until '
        "gpushard's agent there sees its cards advertised (its allocatable lists 0 of its 8 cards); if it stays, "
        "read that agent's log",
    ]


def test_json_and_selector(kubeconfig, capsys):
    assert cli.main(["status", "--kubeconfig", kubeconfig, "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["node"] for s in report["starting"]] == ["new-short", "new-tainted"]
    assert cli.main(["status", "--kubeconfig", kubeconfig, "-o", "json", "-l", "kubernetes.io/hostname=gpu-8x"]) == 0
    assert json.loads(capsys.readouterr().out)["starting"] == []


def test_under_dra_only_the_taint_says_starting():
    dra = policy_mod.Policy(backend=policy_mod.DRA)
    assert auditing.starting(new_node("n", 3, []), dra) is None
    assert "startup taint" in auditing.starting(new_node("n", 0, [names.STARTUP_TAINT]), dra)
    assert auditing.starting(world.shared_node("up", 8, world.H100), policy_mod.Policy()) is None
