"""We test, over real gRPC with the fake kubelet, how the card-k plugin names its card (deviceListStrategy):
- each strategy, and lists of them, give exactly the env, /dev/null mounts under
  /var/run/nvidia-container-devices and CDI names (nvidia.com/gpu=<uuid>) of the card; the
  aggregate gpushard.io/gpu names nothing in any strategy;
- what the container then sees (tests/agent/toolkit.py: the kubelet's merge and the toolkit's
  rules) on a node with the toolkit's defaults and on a hardened node (env ignored for
  unprivileged containers, mounts accepted): with the default strategy, exactly its card on both,
  even when the author writes NVIDIA_VISIBLE_DEVICES=all; a container that asks no GPU, or only
  gpushard.io/gpu, sees no card on a hardened node whatever its image says;
- a strategy a node cannot resolve shows as a failing container, which is why cdi-cri is not the default;
- a list without envvar still sets NVIDIA_VISIBLE_DEVICES, to a value naming no card (the device-list
  folder with volume-mounts, as NVIDIA's plugin does; void with cdi-cri alone), so a CUDA image's own
  `all` never stands: on a node with the toolkit's defaults the container gets its card or fails,
  never every card.
"""

from __future__ import annotations

import pytest

from tests.agent import fakekubelet, toolkit
from webhook import settings
from webhook.agent import running
from webhook.agent.node import nvml
from webhook.agent.proto import deviceplugin_pb2 as pb

CARDS = [nvml.Card(0, "GPU-11111111-aaaa", "NVIDIA H100 80GB HBM3", 81559),
         nvml.Card(1, "GPU-22222222-bbbb", "NVIDIA H100 80GB HBM3", 81559)]
NODE_CARDS = [(c.index, c.uuid) for c in CARDS]
ENDPOINTS = {"gpushard.io/gpu": "gpushard-io-gpu.sock", "gpushard.io/card-0": "gpushard-io-card-0.sock",
             "gpushard.io/card-1": "gpushard-io-card-1.sock"}
CUDA_IMAGE_ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}


class Node:
    """A running agent with one config, a fake kubelet, and Allocate as the kubelet calls it."""

    def __init__(self, strategy=None):
        config = {"sharesPerCard": 4}
        if strategy is not None:
            config["deviceListStrategy"] = strategy
        self.directory = fakekubelet.short_tempdir()
        self.kubelet = fakekubelet.FakeKubelet(self.directory).start()
        self.agent = running.Agent(nvml.FakeDevices(CARDS), settings.from_mapping(config).policy, self.directory,
                                   poll=0.05, tick=0.2, register_timeout=2)
        self.agent.start()
        self.kubelet.wait_for(set(ENDPOINTS))

    def allocate(self, resource: str, ids: list[str]) -> pb.ContainerAllocateResponse:
        with fakekubelet.PluginClient(self.directory, ENDPOINTS[resource]) as c:
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
            (response,) = c.stub.Allocate(request, timeout=2).container_responses
        return response

    def holding(self, k: int, shares: int = 2) -> list[pb.ContainerAllocateResponse]:
        """What a container that gpushard pinned to card k gets: both resources' allocations."""
        ids = [f"card-{k}-{s}" for s in range(shares)]
        return [self.allocate("gpushard.io/gpu", [f"card-{1 - k}-3"]), self.allocate(f"gpushard.io/card-{k}", ids)]

    def close(self):
        self.agent.stop()
        self.kubelet.stop()
        fakekubelet.remove_tree(self.directory)


@pytest.fixture
def node(request):
    made = Node(getattr(request, "param", None))
    yield made
    made.close()


def parts(response: pb.ContainerAllocateResponse):
    return (dict(response.envs), [(m.host_path, m.container_path, m.read_only) for m in response.mounts],
            [d.name for d in response.cdi_devices])


MOUNT_1 = ("/dev/null", "/var/run/nvidia-container-devices/GPU-22222222-bbbb", True)


@pytest.mark.parametrize("node, expected", [
    (None, ({"NVIDIA_VISIBLE_DEVICES": "GPU-22222222-bbbb"}, [MOUNT_1], [])),
    (["envvar"], ({"NVIDIA_VISIBLE_DEVICES": "GPU-22222222-bbbb"}, [], [])),
    (["volume-mounts"], ({"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}, [MOUNT_1], [])),
    ("cdi-cri", ({"NVIDIA_VISIBLE_DEVICES": "void"}, [], ["nvidia.com/gpu=GPU-22222222-bbbb"])),
    (["cdi-cri", "volume-mounts"], ({"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}, [MOUNT_1],
                                    ["nvidia.com/gpu=GPU-22222222-bbbb"])),
    (["envvar", "volume-mounts", "cdi-cri"],
     ({"NVIDIA_VISIBLE_DEVICES": "GPU-22222222-bbbb"}, [MOUNT_1], ["nvidia.com/gpu=GPU-22222222-bbbb"])),
], indirect=["node"])
def test_each_strategy_names_the_card_exactly(node, expected):
    assert parts(node.allocate("gpushard.io/card-1", ["card-1-0", "card-1-3"])) == expected
    # The aggregate is a sum for quotas: it names no device, whatever the strategy.
    assert node.allocate("gpushard.io/gpu", ["card-0-1", "card-1-2"]) == pb.ContainerAllocateResponse()


@pytest.mark.parametrize("where", [toolkit.DEFAULT_NODE, toolkit.HARDENED_NODE], ids=["default", "hardened"])
def test_the_default_strategy_gives_exactly_the_card_on_both_kinds_of_node(node, where):
    # In an enforce namespace the webhook wrote NVIDIA_VISIBLE_DEVICES=<k> into the container.
    for k in (0, 1):
        c = toolkit.container(node.holding(k), own_env={"NVIDIA_VISIBLE_DEVICES": str(k)}, image_env=CUDA_IMAGE_ENV)
        assert toolkit.visible_cards(c, where, NODE_CARDS) == {CARDS[k].uuid}


def test_an_author_written_all_is_inert_on_a_hardened_node(node):
    # The author's own env comes last; the toolkit reads the plugin's mount first and ignores the env.
    c = toolkit.container(node.holding(1), own_env={"NVIDIA_VISIBLE_DEVICES": "all"}, image_env=CUDA_IMAGE_ENV)
    assert toolkit.visible_cards(c, toolkit.HARDENED_NODE, NODE_CARDS) == {CARDS[1].uuid}
    # On a node with the toolkit's defaults only admission (enforce) keeps this out: the env wins there.
    assert toolkit.visible_cards(c, toolkit.DEFAULT_NODE, NODE_CARDS) == {card.uuid for card in CARDS}


def test_the_env_alone_would_not_hold_on_a_hardened_node():
    # Why volume-mounts is in the default: with envvar alone a hardened node gives the card to nobody.
    allocation = Node(["envvar"])
    try:
        c = toolkit.container(allocation.holding(0), image_env=CUDA_IMAGE_ENV)
        assert toolkit.visible_cards(c, toolkit.HARDENED_NODE, NODE_CARDS) == set()
    finally:
        allocation.close()


@pytest.mark.parametrize("own_env", [{}, {"NVIDIA_VISIBLE_DEVICES": "all"}, {"NVIDIA_VISIBLE_DEVICES": "0,1"}])
def test_a_cuda_image_asking_for_nothing_sees_no_card_on_a_hardened_node(own_env):
    # No allocation at all: a namespace that did not opt in, a container that asked for nothing.
    c = toolkit.container([], own_env=own_env, image_env=CUDA_IMAGE_ENV)
    assert toolkit.visible_cards(c, toolkit.HARDENED_NODE, NODE_CARDS) == set()
    # A privileged container still would: admission denies those in enforce namespaces.
    c.privileged = True
    assert toolkit.visible_cards(c, toolkit.HARDENED_NODE, NODE_CARDS) == {card.uuid for card in CARDS}


def test_the_aggregate_alone_gives_no_card_on_a_hardened_node(node):
    # gpushard.io/gpu: n without a card resource (what the guard outside enforce namespaces denies).
    c = toolkit.container([node.allocate("gpushard.io/gpu", ["card-0-0", "card-1-1"])],
                          own_env={"NVIDIA_VISIBLE_DEVICES": "all"}, image_env=CUDA_IMAGE_ENV)
    assert toolkit.visible_cards(c, toolkit.HARDENED_NODE, NODE_CARDS) == set()


@pytest.mark.parametrize("node", [["cdi-cri"]], indirect=True)
def test_cdi_fails_the_container_on_a_node_without_the_spec(node):
    c = toolkit.container(node.holding(0))
    assert toolkit.visible_cards(c, toolkit.HARDENED_NODE, NODE_CARDS) == {CARDS[0].uuid}
    with pytest.raises(ValueError, match="unresolvable CDI device 'nvidia.com/gpu=GPU-11111111-aaaa'"):
        toolkit.visible_cards(c, toolkit.Node(cdi_kind="k8s.device-plugin.nvidia.com/gpu"), NODE_CARDS)


@pytest.mark.parametrize("node", [["volume-mounts"]], indirect=True)
def test_volume_mounts_alone_never_lets_an_images_all_stand(node):
    # No webhook env (the author's container env is absent): only the image's `all` and the plugin's answer.
    c = toolkit.container(node.holding(1), image_env=CUDA_IMAGE_ENV)
    assert toolkit.visible_cards(c, toolkit.HARDENED_NODE, NODE_CARDS) == {CARDS[1].uuid}
    # With the toolkit's defaults the env is read: the device-list folder names no card, so the toolkit
    # fails the container (as with NVIDIA's plugin in this strategy) instead of giving it every card.
    with pytest.raises(ValueError, match="unknown device '/var/run/nvidia-container-devices'"):
        toolkit.visible_cards(c, toolkit.DEFAULT_NODE, NODE_CARDS)
    # The webhook's NVIDIA_VISIBLE_DEVICES=<k> in an enforce namespace comes last and still names the card.
    c = toolkit.container(node.holding(1), own_env={"NVIDIA_VISIBLE_DEVICES": "1"}, image_env=CUDA_IMAGE_ENV)
    assert toolkit.visible_cards(c, toolkit.DEFAULT_NODE, NODE_CARDS) == {CARDS[1].uuid}


@pytest.mark.parametrize("node", [["cdi-cri"]], indirect=True)
def test_cdi_alone_gives_exactly_the_card_whatever_the_image_says(node):
    c = toolkit.container(node.holding(0), image_env=CUDA_IMAGE_ENV)
    for where in (toolkit.DEFAULT_NODE, toolkit.HARDENED_NODE):
        assert toolkit.visible_cards(c, where, NODE_CARDS) == {CARDS[0].uuid}


# What running containers showed (tests/runtime, docs/e2e.md), restated on the model: a node with NVIDIA's CDI
# spec and no hook, and a node with the hook and a runtime without CDI.
SHIPPED = ["envvar", "volume-mounts", "cdi-cri"]


@pytest.mark.parametrize("node", [toolkit.DEFAULT_NODE, toolkit.HARDENED_NODE, toolkit.CDI_ONLY_NODE,
                                  toolkit.NO_CDI_NODE], ids=["defaults", "hardened", "cdi-only", "no-cdi"])
@pytest.mark.parametrize("own", [{}, {"NVIDIA_VISIBLE_DEVICES": "1"}], ids=["no-own-env", "webhook-env"])
def test_the_shipped_list_gives_exactly_the_card_on_every_kind_of_node(node, own):
    n = Node(SHIPPED)
    try:
        c = toolkit.container(n.holding(1), own_env=own, image_env=CUDA_IMAGE_ENV)
        assert toolkit.visible_cards(c, node, NODE_CARDS) == {CARDS[1].uuid}
    finally:
        n.close()


def test_without_cdi_in_the_list_a_cdi_only_node_gives_no_card():
    """The program's default list on a node without NVIDIA's hook: the variable and the mount are only data."""
    n = Node()
    try:
        c = toolkit.container(n.holding(1), own_env={"NVIDIA_VISIBLE_DEVICES": "1"}, image_env=CUDA_IMAGE_ENV)
        assert toolkit.visible_cards(c, toolkit.CDI_ONLY_NODE, NODE_CARDS) == set()
    finally:
        n.close()


def test_cdi_alone_on_a_runtime_without_cdi_leaves_only_the_pods_variable():
    """The runtime drops the CDI name; what is left is the pod's NVIDIA_VISIBLE_DEVICES (the webhook's in an
    enforce namespace), which comes after the agent's void."""
    n = Node(["cdi-cri"])
    try:
        alone = toolkit.container(n.holding(1), image_env=CUDA_IMAGE_ENV)
        assert toolkit.visible_cards(alone, toolkit.NO_CDI_NODE, NODE_CARDS) == set()
        enforced = toolkit.container(n.holding(1), own_env={"NVIDIA_VISIBLE_DEVICES": "1"}, image_env=CUDA_IMAGE_ENV)
        assert toolkit.visible_cards(enforced, toolkit.NO_CDI_NODE, NODE_CARDS) == {CARDS[1].uuid}
    finally:
        n.close()
