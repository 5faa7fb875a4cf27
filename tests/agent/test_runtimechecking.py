"""We test the DRA backend's check of the node's container runtime, as `gpushard agent` runs it (the local API
server holds the Node with the runtime version its kubelet reports; the kubelet's DRA side from its protos):
- on containerd 1.6 the slice offers no card, a claim is refused with the reason (what the kubelet puts in the
  pod's events), and the Node's inventory says why on every card; the log says it once, at ERROR;
- the runtime upgraded under the running agent (containerd 2) is seen at the next check: the cards come back
  into the slice and claims are prepared;
- a runtime gpushard cannot judge is served, with a warning; the operator's `agent.runtimeCDI: false` refuses;
- until the runtime was read once, nothing is offered.
"""

import json
import logging
import os

import pytest

from tests.agent import drakubelet, draworld, fakekubelet
from tests.agent.test_drabackend import CARDS, NODE, slice_devices
from tests.polling import eventually
from webhook.agent import running
from webhook.agent.dra import backend, runtimechecking
from webhook.agent.node import nvml, publishing
from webhook.core import names
from webhook.core import policy as policy_mod


def node(version: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}},
            "status": {"nodeInfo": {**{k: "" for k in INFO}, "containerRuntimeVersion": version}}}


# Every field a kubelet reports in nodeInfo (the API client's Node model wants them all).
INFO = ("architecture", "bootID", "kernelVersion", "kubeProxyVersion", "kubeletVersion", "machineID",
        "operatingSystem", "osImage", "systemUUID")


class Kept(logging.Handler):
    """Every record of the checker's logger, whichever test phase its thread logs in."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def logged():
    kept, logger = Kept(), logging.getLogger("webhook.agent.dra.runtimechecking")
    logger.addHandler(kept)
    before, logger.level = logger.level, logging.INFO
    yield kept.records
    logger.removeHandler(kept)
    logger.setLevel(before)


@pytest.fixture
def world(api, plugin_dir, kubelet, logged):
    # The first verdict is logged as the agent starts, in this fixture: ``logged`` keeps it.
    api.put("nodes", node("containerd://1.6.20~ds1"))
    root = fakekubelet.short_tempdir("gsr-")
    folders = backend.Folders(os.path.join(root, "reg"), os.path.join(root, "plugins"), os.path.join(root, "cdi"))
    client = api.api_client()
    checker = runtimechecking.Checker(client, NODE, interval=0.1)
    agent = running.Agent(nvml.FakeDevices(CARDS), policy_mod.Policy(backend=policy_mod.DRA), plugin_dir,
                          publisher=lambda cards: publishing.Publisher(client, NODE, cards, retry=0.1),
                          poll=0.05, tick=0.2, register_timeout=2,
                          backend=lambda a: backend.DraBackend(client, NODE, a.devices, a.cards, a.board, a.policy,
                                                               folders, poll=0.05, runtime=checker,
                                                               cordoned=a.cordoned))
    agent.start()
    yield agent, checker, folders
    agent.stop()
    fakekubelet.remove_tree(root)


def prepare(agent, api, uid):
    api.put("resourceclaims", draworld.reserved(draworld.claim("team-a", f"c-{uid}", uid, NODE, "card-0", 50), "p",
                                                f"pod-{uid}"))
    api.put("pods", draworld.holder("team-a", "p", f"pod-{uid}", 20, 30))
    peer = drakubelet.DraKubelet()
    eventually(lambda: os.path.exists(agent.backend.plugin.registration_path), "the registration socket")
    peer.register(agent.backend.plugin.registration_path)
    return peer.prepare(("team-a", uid, f"c-{uid}")).claims[uid]


def test_containerd_16_takes_no_claim_and_says_why(api, world, logged):
    agent, checker, folders = world
    eventually(lambda: checker.read_once, "the runtime read")
    eventually(lambda: slice_devices(api) == [], "a slice with no card")
    entry = prepare(agent, api, "uid-1")
    assert "cannot be prepared on node 'node-a'" in entry.error
    assert "containerd://1.6.20~ds1 has no CDI" in entry.error
    assert not os.path.exists(os.path.join(folders.cdi, "gpushard.io-claim_uid-1.json"))
    details = agent.inventory_details()["cards"]
    assert all("has no CDI" in details[c.index]["draRefused"] for c in CARDS)
    errors = [r for r in logged if r.levelno == logging.ERROR and "has no CDI" in r.getMessage()]
    assert len(errors) == 1, errors


def test_an_upgraded_runtime_is_served(api, world):
    agent, checker, folders = world
    eventually(lambda: slice_devices(api) == [], "a slice with no card")
    api.put("nodes", node("containerd://2.2.0"))
    eventually(lambda: slice_devices(api) == ["card-0", "card-1"], "the cards back in the slice")
    entry = prepare(agent, api, "uid-2")
    assert entry.error == ""
    assert list(entry.devices[0].cdi_device_ids) == ["nvidia.com/gpu=GPU-aaaa", "gpushard.io/claim=uid-2-card-0"]
    assert "draRefused" not in agent.inventory_details()["cards"][0]


def test_a_runtime_not_known_is_served_with_a_warning(api, caplog):
    api.put("nodes", node("cri-o://1.30.4"))
    checker = runtimechecking.Checker(api.api_client(), NODE)
    caplog.set_level(logging.INFO)
    verdict = checker.check_once()
    assert verdict.applies is None and checker.serves()
    assert any(r.levelno == logging.WARNING and "cannot tell whether cri-o://1.30.4" in r.getMessage()
               for r in caplog.records)


def test_the_operator_can_refuse(api):
    api.put("nodes", node("containerd://2.2.0"))
    checker = runtimechecking.Checker(api.api_client(), NODE, declared="false")
    checker.check_once()
    assert not checker.serves() and "agent.runtimeCDI is false" in checker.card_details()["draRefused"]


def test_nothing_is_offered_before_the_first_read():
    checker = runtimechecking.Checker(None, NODE, read=lambda: (_ for _ in ()).throw(OSError("unreachable")))
    checker.check_once()
    assert not checker.read_once and not checker.serves() and checker.card_details() == {}


def test_inventory_names_the_refusal(api, world):
    agent, checker, _folders = world
    eventually(lambda: checker.read_once, "the runtime read")

    def refused():
        annotations = api.get("nodes", NODE)["metadata"].get("annotations") or {}
        if names.INVENTORY_ANNOTATION not in annotations:
            return False
        return all("draRefused" in c for c in json.loads(annotations[names.INVENTORY_ANNOTATION]))
    eventually(refused, "the inventory naming the refusal")
