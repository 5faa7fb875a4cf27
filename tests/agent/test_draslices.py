"""We test, against the local API server:
- the node's ResourceSlice is created at generation 0 with one device per card, passing the API's rules;
- a card that turns Unhealthy or disappears leaves the slice, and comes back on recovery, each time with a higher
  pool generation and the resourceVersion of the slice it replaces;
- nothing is written when nothing changed; a slice deleted under it (the kubelet does, after the plugin
  unregisters) is made again by the periodic look;
- an API server that fails is retried; a slice that would break a rule is never sent.
"""

import threading

from tests.polling import eventually
from webhook.agent.dra import slices
from webhook.core import draobjects, names

CARDS = [draobjects.CardFacts(i, f"GPU-{i}", "NVIDIA L4", 23034) for i in range(3)]



def stored(api, node="node-a"):
    return api.get("resourceslices", draobjects.slice_name(node))


def writes(api):
    return [(m, p) for m, p, _ in api.requests if m in ("POST", "PUT")]


def test_created_with_one_device_per_card(api):
    publisher = slices.SlicePublisher(api.api_client(), "node-a", lambda: CARDS, 100)
    assert publisher.publish_once()
    obj = stored(api)
    assert obj["apiVersion"] == names.DRA_API_VERSION and obj["kind"] == "ResourceSlice"
    assert obj["spec"]["pool"] == {"name": "node-a", "generation": 0, "resourceSliceCount": 1}
    assert [d["name"] for d in obj["spec"]["devices"]] == ["card-0", "card-1", "card-2"]
    assert draobjects.check_slice(obj) == []
    assert writes(api) == [("POST", "/apis/resource.k8s.io/v1/resourceslices")]


def test_health_changes_keep_it_current(api):
    present = list(CARDS)
    publisher = slices.SlicePublisher(api.api_client(), "node-a", lambda: present, 100)
    publisher.publish_once()
    first = stored(api)
    present.remove(CARDS[1])  # Unhealthy or gone: the agent publishes only healthy, present cards
    assert publisher.publish_once()
    second = stored(api)
    assert [d["name"] for d in second["spec"]["devices"]] == ["card-0", "card-2"]
    assert second["spec"]["pool"]["generation"] == 1
    put = [body for m, _p, body in api.requests if m == "PUT"]
    assert f'"resourceVersion": "{first["metadata"]["resourceVersion"]}"' in put[-1].decode()
    present.insert(1, CARDS[1])
    publisher.publish_once()
    assert [d["name"] for d in stored(api)["spec"]["devices"]] == ["card-0", "card-1", "card-2"]
    assert stored(api)["spec"]["pool"]["generation"] == 2


def test_nothing_written_when_nothing_changed(api):
    publisher = slices.SlicePublisher(api.api_client(), "node-a", lambda: CARDS, 100)
    publisher.publish_once()
    again = slices.SlicePublisher(api.api_client(), "node-a", lambda: CARDS, 100)  # an agent restarted
    assert again.publish_once()
    assert len(writes(api)) == 1
    assert stored(api)["spec"]["pool"]["generation"] == 0


def test_a_failing_api_server_is_retried(api):
    publisher = slices.SlicePublisher(api.api_client(), "node-a", lambda: CARDS, 100, retry=0.01)
    api.fail_next = [503]
    assert not publisher.publish_once()
    assert publisher.publish_once()
    assert stored(api)["spec"]["devices"]


def test_a_slice_that_breaks_a_rule_is_never_sent(api):
    many = [draobjects.CardFacts(i, f"GPU-{i}", "m", 1) for i in range(129)]
    publisher = slices.SlicePublisher(api.api_client(), "node-a", lambda: many, 100)
    assert publisher.publish_once()  # not retried: the answer would not change
    assert writes(api) == []


def test_a_deleted_slice_is_made_again(api):
    publisher = slices.SlicePublisher(api.api_client(), "node-a", lambda: CARDS, 100, resync=0.05)
    stop = threading.Event()
    thread = threading.Thread(target=publisher.run, args=(stop,), daemon=True)
    thread.start()
    try:
        eventually(lambda: stored_or_none(api) is not None, "the slice published", timeout=20)
        api.delete("resourceslices", draobjects.slice_name("node-a"))
        eventually(lambda: stored_or_none(api) is not None, "the slice published again", timeout=20)
    finally:
        stop.set()
        publisher.changed()
        thread.join(timeout=10)


def stored_or_none(api):
    try:
        return stored(api)
    except KeyError:
        return None
