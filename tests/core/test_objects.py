"""One reading of Nodes and pods (webhook.core.objects) for the live view, the re-placement
controller, audit and status, and the inventory format the agent writes.

We test, one test per point where two readings used to disagree, the one answer now given:
- a node whose agent lists a card it does not (yet) offer: the live view had the card with room 0
  while status left the whole node out; now both show the card, status at capacity 0;
- a card memory that is no positive number (true, -1): the live view took it as 1 and -1 MiB,
  status as 0; now both read 0 (no memory published);
- an inventory annotation nested too deep to parse: the view read no cards from it, audit and
  status failed with a RecursionError; now every reader reads no cards from it;
- an entry whose index is true, or negative: the view kept true as card 1 and audit kept
  both; now neither is a card;
and that the one definition of a shared node (per-card capacity, a listed card, or the agent's
cards label) is what audit and status use, while the view keeps only nodes it can place on;
and that the format the agent writes reads back as it was written.
"""

import json

from webhook import settings
from webhook.cluster import kube
from webhook.core import auditing, names, objects

POLICY = settings.Settings().policy


def node(name: str, allocatable: dict | None = None, inventory: object = None, labels: dict | None = None) -> dict:
    meta: dict = {"name": name, "labels": labels or {}}
    if inventory is not None:
        meta["annotations"] = {names.INVENTORY_ANNOTATION: inventory if isinstance(inventory, str)
                               else json.dumps(inventory)}
    return {"kind": "Node", "metadata": meta, "status": {"allocatable": allocatable or {}}}


def test_a_listed_card_not_offered_shows_in_the_view_and_in_status_alike():
    obj = node("gpu-a", {"gpushard.io/card-0": "100"},
               [{"index": 0, "uuid": "GPU-0", "model": "H100", "memoryMiB": 81559},
                {"index": 1, "uuid": "GPU-1", "model": "H100", "memoryMiB": 81559}])
    view_cards = [(c.index, c.capacity) for c in kube.read_node(obj, POLICY).cards]
    status_cards = [(c.index, c.capacity) for c in auditing.usage([obj], [], POLICY).nodes[0].cards]
    assert view_cards == status_cards == [(0, 100), (1, 0)]
    # A node the agent lists cards on but that offers none yet is shared for both.
    bare = node("gpu-b", {}, [{"index": 0, "uuid": "GPU-0", "model": "H100", "memoryMiB": 81559}])
    assert [c.index for c in kube.read_node(bare, POLICY).cards] == [0]
    assert [(n.name, [c.capacity for c in n.cards]) for n in auditing.usage([bare], [], POLICY).nodes] == [
        ("gpu-b", [0])]


def test_a_card_memory_that_is_no_positive_number_reads_as_none_everywhere():
    obj = node("gpu-a", {"gpushard.io/card-0": "100", "gpushard.io/card-1": "100"},
               [{"index": 0, "memoryMiB": True}, {"index": 1, "memoryMiB": -1}])
    assert [c.memory_mib for c in kube.read_node(obj, POLICY).cards] == [0, 0]
    assert [c.memory_mib for c in auditing.usage([obj], [], POLICY).nodes[0].cards] == [0, 0]


def test_an_inventory_too_deep_to_parse_lists_no_cards_for_any_reader():
    obj = node("gpu-a", {"gpushard.io/card-0": "100"}, "[" * 100_000, {names.CARDS_LABEL: "1"})
    assert [c.index for c in kube.read_node(obj, POLICY).cards] == [0]
    assert auditing.node_cards(obj, POLICY).inventory == {}
    assert [c.index for c in auditing.usage([obj], [], POLICY).nodes[0].cards] == [0]


def test_entries_without_a_card_index_are_no_cards():
    obj = node("gpu-a", {}, [{"index": True, "uuid": "GPU-t"}, {"index": -1, "uuid": "GPU-n"}, "7"],
               {names.CARDS_LABEL: "2"})
    assert kube.read_node(obj, POLICY) is None
    assert objects.node_cards(obj, POLICY).inventory == {}


def test_one_definition_of_a_shared_node():
    offered = node("a", {"gpushard.io/card-0": "100"})
    listed = node("b", {}, [{"index": 0}])
    labelled = node("c", {}, None, {names.CARDS_LABEL: "0"})  # the agent runs there, no card to share
    plain = node("d", {"cpu": "8"}, [{"index": 0, "excluded": "MIG mode is on"}])
    assert [objects.node_cards(n, POLICY).shared for n in (offered, listed, labelled, plain)] == [
        True, True, True, False]
    assert [n.name for n in auditing.usage([offered, listed, labelled, plain], [], POLICY).nodes] == ["a", "b", "c"]
    # The view places on cards: a shared node without any has nothing to offer it.
    assert [kube.read_node(n, POLICY) is not None for n in (offered, listed, labelled, plain)] == [
        True, True, False, False]


def test_the_inventory_the_agent_writes_reads_back():
    text = objects.write_inventory([
        objects.inventory_entry(1, "GPU-1", "L4", 22491, isolation={"mode": "none"}),
        objects.inventory_entry(0, "GPU-0", "H100", 81559, excluded="MIG mode is on"),
    ])
    assert json.loads(text)[0]["index"] == 0  # by card index
    read = objects.read_inventory(text)
    assert list(read) == [1]  # the excluded card is left out
    assert (read[1]["uuid"], read[1]["model"], objects.card_memory(read[1])) == ("GPU-1", "L4", 22491)


def test_a_pods_shares_and_phase():
    pod = {"metadata": {"uid": "u1"}, "status": {"phase": "Succeeded"}, "spec": {"containers": [
        {"name": "a", "resources": {"limits": {"gpushard.io/card-2": "30"}}},
        {"name": "b", "resources": {"limits": {"gpushard.io/card-2": "1.5", "gpushard.io/card-0": "-4"}}}]}}
    assert objects.card_shares(pod["spec"], POLICY) == {2: 31}
    assert objects.terminal(pod) and not objects.terminal({"status": {"phase": "Pending"}})
    assert objects.key(pod) == "u1"
    assert objects.key({"metadata": {"namespace": "ml", "name": "p"}}) == "ml/p"
