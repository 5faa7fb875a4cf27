"""We test `gpushard cordon NODE CARD` and `gpushard uncordon NODE CARD` (and `kubectl gpushard ...`) against the
local API server (tests/fakekube.py):
- cordon writes gpushard.io/card-<k>.cordoned with why, who (the API server's SelfSubjectReview) and when,
  by a merge patch of that one key, so cordons of two cards of a node both stand; it records an Event
  on the Node (namespace default, the Node's name, kind and uid, reason GpushardCardCordoned) saying who
  cordoned which card and why; uncordon removes the key and records GpushardCardUncordoned;
- both are idempotent: a cordoned card is said to be so (exit 0), with no patch and no Event;
- bad input is exit 2 with one `gpushard:` line quoting it: a card that is no integer, a card the node's
  inventory does not list, a node without the agent's inventory, a node that does not exist, a reason
  too long; a card no longer listed can still be uncordoned;
- an API server that forbids the Event after the patch went through says the card is cordoned and the
  Event is missing (exit 3); a SelfSubjectReview it refuses leaves the cordon without a name;
- the webhook's reader and the agent's read what the command wrote (one reader: objects.read_cordons).
(Exit 3 for an API that is down, refuses the token, forbids the calls or never answers: tests/test_exit_codes.py.)
"""

from __future__ import annotations

import json

import pytest

from tests.fakekube import FakeKube
from webhook import cli
from webhook.core import names, objects
from webhook.core.policy import Policy

NODE = "gpu-1"
INVENTORY = [{"index": 0, "uuid": "GPU-aaaa", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559},
             {"index": 1, "uuid": "GPU-bbbb", "model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559}]


def node(name: str = NODE, inventory: list | None = INVENTORY, annotations: dict | None = None) -> dict:
    meta = {"name": name, "labels": {names.CARDS_LABEL: "2"}, "annotations": dict(annotations or {})}
    if inventory is not None:
        meta["annotations"][names.INVENTORY_ANNOTATION] = json.dumps(inventory)
    return {"metadata": meta, "status": {"allocatable": {"gpushard.io/card-0": "100", "gpushard.io/card-1": "100"}}}


@pytest.fixture
def kube(tmp_path):
    with FakeKube() as fake:
        config = tmp_path / "kubeconfig"
        config.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "ops",
            "clusters": [{"name": "c", "cluster": {"server": fake.url}}],
            "users": [{"name": "u", "user": {"token": "alice-token"}}],
            "contexts": [{"name": "ops", "context": {"cluster": "c", "user": "u"}}]}))
        fake.kubeconfig = str(config)
        fake.users["alice-token"] = ("alice@example.com", ("ops",))
        fake.put("nodes", node())
        yield fake


def run(kube, capsys, *argv: str, plugin: bool = False) -> tuple[int, str, str]:
    main = cli.plugin_main if plugin else cli.main
    status = main([*argv, "--kubeconfig", kube.kubeconfig])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def annotations(kube) -> dict:
    return kube.get("nodes", NODE)["metadata"].get("annotations") or {}


def events(kube) -> list[dict]:
    return sorted(kube.objects["events"].values(), key=lambda e: e["metadata"]["resourceVersion"])


def writes(kube) -> list[tuple[str, str, bytes]]:
    return [r for r in kube.requests if r[0] in ("PATCH", "POST", "PUT") and "selfsubjectreviews" not in r[1]]


def test_cordon_writes_the_annotation_and_an_event(kube, capsys):
    status, out, err = run(kube, capsys, "cordon", NODE, "1", "--reason", "fan  replacement")
    assert (status, err) == (0, "")
    assert out == (f"node/{NODE} card 1 cordoned: no new pod is placed on it; the pods on it keep running "
                   "(gpushard status shows them)\n")
    value = json.loads(annotations(kube)[names.card_cordon_annotation(1)])
    assert value["reason"] == "fan replacement" and value["by"] == "alice@example.com"
    assert value["at"].endswith("Z") and len(value["at"]) == 20
    (event,) = events(kube)
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE,
                                       "uid": kube.get("nodes", NODE)["metadata"]["uid"]}
    assert (event["reason"], event["type"], event["action"]) == ("GpushardCardCordoned", "Normal", "Cordon")
    assert event["source"] == {"component": "gpushard-cordon"}
    assert event["message"] == ("gpushard: card 1 (GPU-bbbb, NVIDIA H100 80GB HBM3) cordoned by alice@example.com: "
                                "fan replacement; no new pod is placed on it, and the pods on it keep running")
    # The patch is a merge patch of the one key: nothing else of the Node is written.
    (patch,) = [r for r in writes(kube) if r[0] == "PATCH"]
    assert json.loads(patch[2]) == {"metadata": {"annotations": {names.card_cordon_annotation(1): json.dumps(
        value, separators=(",", ":"))}}}
    # Every reader of a Node sees it: the webhook's view, status, the agent.
    cards = objects.node_cards(kube.get("nodes", NODE), Policy())
    assert cards.cordoned == {1: objects.Cordon("fan replacement", "alice@example.com", value["at"])}


def test_cordons_of_two_cards_both_stand_and_each_is_idempotent(kube, capsys):
    assert run(kube, capsys, "cordon", NODE, "0")[0] == 0
    assert run(kube, capsys, "cordon", NODE, "1", "--reason", "xid 79", plugin=True)[0] == 0
    assert set(objects.read_cordons(annotations(kube))) == {0, 1}
    assert objects.read_cordons(annotations(kube))[0].reason == ""
    before = len(writes(kube))
    status, out, err = run(kube, capsys, "cordon", NODE, "1", "--reason", "another")
    assert (status, err) == (0, "")
    assert out.startswith(f"node/{NODE} card 1 already cordoned (by alice@example.com at ")
    assert out.rstrip().endswith(": xid 79)")
    assert len(writes(kube)) == before and len(events(kube)) == 2


def test_uncordon_removes_the_annotation_and_says_so_in_an_event(kube, capsys):
    run(kube, capsys, "cordon", NODE, "1", "--reason", "fan")
    status, out, err = run(kube, capsys, "uncordon", NODE, "1")
    assert (status, out, err) == (0, f"node/{NODE} card 1 uncordoned: it takes new pods again\n", "")
    assert names.card_cordon_annotation(1) not in annotations(kube)
    assert names.INVENTORY_ANNOTATION in annotations(kube)
    event = events(kube)[-1]
    assert (event["reason"], event["action"]) == ("GpushardCardUncordoned", "Uncordon")
    assert event["message"].startswith("gpushard: card 1 (GPU-bbbb, NVIDIA H100 80GB HBM3) uncordoned by "
                                       "alice@example.com; it takes new pods again (it was cordoned by alice@")
    before = len(writes(kube))
    assert run(kube, capsys, "uncordon", NODE, "1", plugin=True)[:2] == (0, f"node/{NODE} card 1 already uncordoned\n")
    assert len(writes(kube)) == before


def one_line(err: str) -> str:
    assert err.startswith("gpushard: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, said", [
    (("cordon", NODE, "one"), "gpushard: card 'one' is not a card index; give the card's number, e.g. 0 or 3"),
    (("cordon", NODE, "-1"), "gpushard: card '-1' is not a card index"),
    (("cordon", NODE, "1.5"), "gpushard: card '1.5' is not a card index"),
    (("cordon", NODE, "7"), f"gpushard: node '{NODE}' has no card 7: its agent lists cards 0, 1 "
                            "(annotation gpushard.io/inventory)"),
    (("uncordon", NODE, "7"), f"gpushard: node '{NODE}' has no card 7"),
    (("cordon", "cpu-1", "0"), "gpushard: node 'cpu-1' has no gpushard inventory (annotation gpushard.io/inventory): "
                               "no agent publishes its cards there"),
    (("cordon", "nowhere", "0"), "gpushard: no node 'nowhere' in the cluster at http://127.0.0.1:"),
    (("cordon", NODE, "0", "--reason", "x" * 600), "gpushard: --reason is 600 characters; keep it to 512"),
])
def test_bad_input_is_exit_2_in_one_line(kube, capsys, argv, said):
    kube.put("nodes", node("cpu-1", inventory=None))
    status, out, err = run(kube, capsys, *argv)
    assert status == 2 and out == ""
    assert one_line(err).startswith(said), err
    assert writes(kube) == []


def test_a_card_that_left_the_inventory_can_still_be_uncordoned(kube, capsys):
    kube.put("nodes", node(inventory=INVENTORY[:1], annotations={names.card_cordon_annotation(1): "reseat"}))
    status, out, _err = run(kube, capsys, "uncordon", NODE, "1")
    assert status == 0 and "uncordoned" in out
    assert names.card_cordon_annotation(1) not in annotations(kube)


def test_an_event_the_api_forbids_is_said_after_the_cordon_stands(kube, capsys):
    kube.tokens = {"alice-token": ("",)}  # cluster-scoped calls only: no Events in namespace default
    status, out, err = run(kube, capsys, "cordon", NODE, "1")
    assert status == 3 and "cordoned" in out
    line = one_line(err)
    assert line.startswith(f"gpushard: node/{NODE} card 1 is cordoned, but its Event was not recorded: ")
    assert "forbids this account to create an Event in namespace 'default' (403 Forbidden" in line
    assert names.card_cordon_annotation(1) in annotations(kube)


def test_a_refused_self_review_leaves_the_cordon_without_a_name(kube, capsys):
    kube.fail_next = [0, 403]  # the Node read passes, the SelfSubjectReview is refused
    assert run(kube, capsys, "cordon", NODE, "0", "--reason", "fan")[0] == 0
    assert objects.read_cordons(annotations(kube))[0].by == ""
    assert events(kube)[-1]["message"].startswith("gpushard: card 0 (GPU-aaaa, NVIDIA H100 80GB HBM3) cordoned: fan;")
