"""We test the agent's removal of the autoscaler's startup taint, against the local API server
(tests/fakekube.py) holding its Node, the test writing the Node's allocatable as the kubelet would:
- with startup-taint.cluster-autoscaler.kubernetes.io/gpushard on its Node, the agent keeps it while the
  allocatable lacks any of its resources (the node-wide one and each card's), and removes it once all show,
  leaving the Node's other taints as they were;
- a cordoned card's resource (0 in the allocatable) does not keep the taint;
- without the taint the agent never writes the Node's spec;
- the removal tests the Node's resourceVersion: applied to a newer Node it fails, and nothing is dropped.
"""

from __future__ import annotations

import copy

import jsonpatch
import pytest

from tests.agent.test_cordons import CARDS, NODE, SHARES, node, watcher
from tests.polling import eventually
from webhook import settings
from webhook.agent import running
from webhook.agent.node import nvml, startuptaint
from webhook.core import names

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
STARTUP = {"key": names.STARTUP_TAINT, "effect": "NoSchedule"}
ALL = {"gpushard.io/gpu": str(len(CARDS) * SHARES), "gpushard.io/card-0": str(SHARES),
       "gpushard.io/card-1": str(SHARES)}


def starting(allocatable: dict[str, str], cordons: dict[int, str] | None = None, taints=(GPU_TAINT, STARTUP)) -> dict:
    found = node(cordons)
    found["spec"] = {"taints": [dict(t) for t in taints]} if taints else {}
    found["status"] = {"allocatable": {"cpu": "8", **allocatable}}
    return found


def make_agent(api, plugin_dir) -> running.Agent:
    policy = settings.from_mapping({"sharesPerCard": SHARES}).policy
    return running.Agent(nvml.FakeDevices(CARDS), policy, plugin_dir, poll=0.05, tick=0.2, register_timeout=2,
                         cordons=watcher(api),
                         startup=lambda wanted: startuptaint.Lifter(api.api_client(), NODE, wanted, retry=0.1))


@pytest.fixture
def agent(api, plugin_dir, kubelet):
    made = []
    yield lambda: made.append(make_agent(api, plugin_dir)) or made[-1]
    for one in made:
        one.stop()


def test_the_taint_stays_until_every_resource_shows_then_goes_alone(api, agent):
    api.put("nodes", starting({}))
    running_agent = agent()
    running_agent.start()
    lifter = running_agent.startup
    wanted = ("gpushard.io/gpu", "gpushard.io/card-0", "gpushard.io/card-1")
    eventually(lambda: lifter._said == wanted, "the agent waiting for every resource")
    api.put("nodes", starting({"gpushard.io/gpu": ALL["gpushard.io/gpu"], "gpushard.io/card-0": str(SHARES),
                               "gpushard.io/card-1": "0"}))
    eventually(lambda: lifter._said == ("gpushard.io/card-1",), "the agent waiting for card 1 alone")
    assert api.get("nodes", NODE)["spec"]["taints"] == [GPU_TAINT, STARTUP]
    api.put("nodes", starting(ALL))
    eventually(lambda: api.get("nodes", NODE)["spec"].get("taints") == [GPU_TAINT], "the startup taint removed")
    assert lifter.lifted
    stored = api.get("nodes", NODE)
    assert stored["metadata"]["annotations"]["keep"] == "me"
    assert stored["status"]["allocatable"] == {"cpu": "8", **ALL}


def test_a_cordoned_card_does_not_keep_the_taint(api, agent):
    api.put("nodes", starting({**ALL, "gpushard.io/card-1": "0"}, cordons={1: "fan"}, taints=(STARTUP,)))
    running_agent = agent()
    running_agent.start()
    eventually(lambda: "taints" not in api.get("nodes", NODE)["spec"], "the last taint removed")


def test_without_the_taint_the_spec_is_never_written(api, agent):
    api.put("nodes", starting({}, taints=(GPU_TAINT,)))
    running_agent = agent()
    running_agent.start()
    eventually(lambda: running_agent.cordons.read, "the Node read")
    api.put("nodes", starting(ALL, taints=(GPU_TAINT,)))
    eventually(lambda: api.get("nodes", NODE)["status"]["allocatable"] == {"cpu": "8", **ALL}, "the Node written")
    running_agent.stop()
    assert not [body for method, _path, body in api.requests if method == "PATCH" and b"taints" in body]
    assert not running_agent.startup.lifted


def test_the_removal_applies_only_to_the_node_it_read():
    read = starting(ALL)
    read["metadata"]["resourceVersion"] = "7"
    patch = startuptaint.lift_patch(read)
    assert jsonpatch.apply_patch(read, patch)["spec"]["taints"] == [GPU_TAINT]
    newer = copy.deepcopy(read)
    newer["metadata"]["resourceVersion"] = "8"
    newer["spec"]["taints"].append({"key": "dedicated", "value": "ml", "effect": "NoSchedule"})
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(newer, patch)


def test_missing_reads_absent_and_zero_as_not_shown():
    shown = {"status": {"allocatable": {"a": "4", "b": "0"}}}
    assert startuptaint.missing(shown, ["a", "b", "c"]) == ["b", "c"]
    assert startuptaint.missing({}, ["a"]) == ["a"]
