"""We test backend dra's count in the Node's status (webhook/agent/dra/nodecount.py) against the local API server
(tests/fakekube.py), with a kubelet device-manager checkpoint written as the kubelet writes it:
- the count goes into capacity and allocatable by one merge patch of nodes/status, and nothing else is sent;
- while the kubelet's checkpoint lists the resource among a device plugin's registered devices (a node that
  ran the device-plugin backend, within the kubelet's five minutes), nothing is written and the agent says
  why; once the kubelet rewrites its checkpoint without it, the count is written; a checkpoint that is not
  there or not of that shape holds nothing back;
- an API server that refuses (403) is retried, said once with the right the agent lacks, and the count lands
  once it is allowed; one that fails (500) is retried too;
- a Node seen without the count, or with another value, is written again; one seen with it is not.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest

from tests import fakekube
from tests.polling import eventually
from webhook.agent.dra import nodecount
from webhook.core import names

NODE = "gpu-node-1"
COUNT = names.SHARES_RESOURCE


@pytest.fixture
def api():
    with fakekube.FakeKube() as server:
        server.put("nodes", {"metadata": {"name": NODE}, "status": {"capacity": {"cpu": "8"},
                                                                    "allocatable": {"cpu": "8"}}})
        yield server


@pytest.fixture
def running():
    started = []

    def run(keeper: nodecount.Keeper) -> nodecount.Keeper:
        stop = threading.Event()
        thread = threading.Thread(target=keeper.run, args=(stop,), daemon=True)
        thread.start()
        started.append((stop, thread))
        return keeper

    yield run
    for stop, thread in started:
        stop.set()
        thread.join(timeout=5)


def checkpoint(folder, registered: dict) -> None:
    """The kubelet's device-manager checkpoint (pkg/kubelet/cm/devicemanager/checkpoint), as it writes it."""
    (folder / nodecount.KUBELET_CHECKPOINT).write_text(json.dumps(
        {"Data": {"PodDeviceEntries": [], "RegisteredDevices": registered}, "Checksum": 1234567890}))


def status_patches(api) -> list[dict]:
    return [json.loads(body) for method, path, body in api.requests
            if method == "PATCH" and path.startswith(f"/api/v1/nodes/{NODE}/status")]


def counted(api):
    return nodecount.advertised(api.get("nodes", NODE), COUNT)


def test_the_count_is_one_merge_patch_of_the_status(api, running):
    keeper = running(nodecount.Keeper(api.api_client(), NODE, COUNT, 200, retry=(0.05, 0.2)))
    eventually(lambda: counted(api) == ("200", "200"), "the count")
    assert status_patches(api) == [{"status": {"capacity": {COUNT: "200"}, "allocatable": {COUNT: "200"}}}]
    assert api.get("nodes", NODE)["status"]["capacity"]["cpu"] == "8"
    eventually(lambda: keeper.writes == 1, "the write counted")  # once its answer is read


def test_nothing_is_written_while_the_kubelet_counts_it_as_a_device_plugin_s(api, running, tmp_path, caplog):
    checkpoint(tmp_path, {COUNT: [f"share-{n}" for n in range(200)], "nvidia.com/gpu": ["GPU-1"]})
    caplog.set_level(logging.INFO, logger="webhook.agent.dra.nodecount")
    keeper = running(nodecount.Keeper(api.api_client(), NODE, COUNT, 200, retry=(0.05, 0.2),
                                      device_plugin_dir=str(tmp_path), held_poll=0.05))
    eventually(lambda: keeper.held, "the agent see the kubelet's hold")
    eventually(lambda: keeper.held_polls >= 5, "several polls of the kubelet's checkpoint")
    assert status_patches(api) == [] and counted(api) == (None, None)
    held = [r.getMessage() for r in caplog.records if "still counts" in r.getMessage()]
    assert len(held) == 1 and "kubelet_internal_checkpoint" in held[0] and "Pending" in held[0]
    # The kubelet lets go (five minutes after the plugin stopped): its checkpoint no longer lists the resource.
    checkpoint(tmp_path, {"nvidia.com/gpu": ["GPU-1"]})
    eventually(lambda: counted(api) == ("200", "200"), "the count once the kubelet let go")
    assert not keeper.held
    assert len(status_patches(api)) == 1


@pytest.mark.parametrize("text", ["", "not json", json.dumps([1, 2]), json.dumps({"Data": {"RegisteredDevices": 3}})])
def test_a_checkpoint_not_of_the_kubelet_s_shape_holds_nothing_back(api, running, tmp_path, text):
    (tmp_path / nodecount.KUBELET_CHECKPOINT).write_text(text)
    running(nodecount.Keeper(api.api_client(), NODE, COUNT, 200, retry=(0.05, 0.2), device_plugin_dir=str(tmp_path),
                             held_poll=0.05))
    eventually(lambda: counted(api) == ("200", "200"), "the count")


def test_a_refusal_is_retried_and_said_once_with_the_right_it_needs(api, running, caplog):
    api.tokens, api.refused = {"agent": None}, {"agent": ("nodes/status",)}
    client = api.api_client()
    client.configuration.api_key = {"authorization": "agent"}
    client.configuration.api_key_prefix = {"authorization": "Bearer"}
    caplog.set_level(logging.WARNING, logger="webhook.agent.dra.nodecount")
    keeper = running(nodecount.Keeper(client, NODE, COUNT, 200, retry=(0.02, 0.05)))
    eventually(lambda: len(status_patches(api)) >= 4, "several tries")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "patch on nodes/status" in said[0] and "403" in said[0], said
    assert counted(api) == (None, None) and keeper.writes == 0
    api.refused = {}
    eventually(lambda: counted(api) == ("200", "200"), "the count once allowed")


def test_a_failing_api_server_is_retried(api, running):
    api.fail_next = [500, 500, 503]
    running(nodecount.Keeper(api.api_client(), NODE, COUNT, 200, retry=(0.02, 0.05)))
    eventually(lambda: counted(api) == ("200", "200"), "the count after the failures")


def test_a_node_seen_without_its_count_is_written_again(api, running):
    keeper = running(nodecount.Keeper(api.api_client(), NODE, COUNT, 200, retry=(0.05, 0.2)))
    eventually(lambda: keeper.writes == 1, "the first write")
    keeper.seen(api.get("nodes", NODE))  # as written: nothing to do
    assert not keeper.due and keeper.writes == 1
    for zeroed in ({"capacity": {COUNT: "0"}, "allocatable": {COUNT: "0"}},  # the kubelet dropped a plugin's
                   {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}},  # gone
                   {"capacity": {COUNT: "200"}, "allocatable": {COUNT: "150"}}):
        writes = keeper.writes
        node = {"metadata": {"name": NODE}, "status": zeroed}
        keeper.seen(node)
        eventually(lambda wanted=writes + 1: keeper.writes == wanted, f"a write after {zeroed}")
    keeper.seen(None)  # a Node deleted: the kubelet registers it anew, and that one is seen
    assert not keeper.due and keeper.writes == 4
