"""We test:
- the resources the agent advertises (names from the config, socket names, card order);
- share IDs: at most 63 characters, parsed back, and health per card in the device list;
- Allocate: card k's UUID for gpushard.io/card-<k>, nothing for gpushard.io/gpu, errors for foreign IDs;
- the env a container holding both resources ends with after the kubelet merges them, in either order;
- the preferred allocation: required IDs first, then the lowest shares.
"""

import itertools

import pytest

from webhook import settings
from webhook.agent.node import allocation, nvml
from webhook.core import names

CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559),
         nvml.Card(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 81559)]


def policy(**data):
    return settings.from_mapping(data).policy


def test_resources_are_the_shares_resource_then_one_per_card():
    found = allocation.resources(list(reversed(CARDS)), policy())
    assert [(r.name, r.endpoint, r.card_index) for r in found] == [
        ("gpushard.io/gpu", "gpushard-io-gpu.sock", None),
        ("gpushard.io/card-0", "gpushard-io-card-0.sock", 0),
        ("gpushard.io/card-1", "gpushard-io-card-1.sock", 1),
    ]


def test_resource_names_come_from_the_config():
    found = allocation.resources(CARDS[:1], policy(resources={"shares": "example.com/shares",
                                                              "cardPrefix": "example.com/gpu-"}))
    assert [r.name for r in found] == ["example.com/shares", "example.com/gpu-0"]
    assert [r.endpoint for r in found] == ["example-com-shares.sock", "example-com-gpu-0.sock"]


def test_no_cards_still_advertise_the_shares_resource_empty():
    found = allocation.resources([], policy())
    assert [r.name for r in found] == ["gpushard.io/gpu"]
    assert allocation.device_list(found[0], [], {}, 100) == []


@pytest.mark.parametrize("card,share", [(0, 0), (7, 99), (12345, 999)])
def test_share_ids_are_short_and_parse_back(card, share):
    device = allocation.device_id(card, share)
    assert len(device) <= allocation.MAX_DEVICE_ID
    assert allocation.parse_device_id(device) == (card, share)


@pytest.mark.parametrize("text", ["card-1", "card-01-2", "gpu-1-2", "card-1-2-3", "card--1-2", ""])
def test_other_text_is_no_share_id(text):
    assert allocation.parse_device_id(text) is None


def test_device_list_marks_each_card_s_shares_by_its_health():
    gpu, card0, card1 = allocation.resources(CARDS, policy())
    healthy = {0: True, 1: False}
    assert allocation.device_list(card0, CARDS, healthy, 3) == [
        ("card-0-0", "Healthy"), ("card-0-1", "Healthy"), ("card-0-2", "Healthy")]
    assert allocation.device_list(card1, CARDS, healthy, 2) == [("card-1-0", "Unhealthy"), ("card-1-1", "Unhealthy")]
    listed = allocation.device_list(gpu, CARDS, healthy, 100)
    assert len(listed) == 200
    assert sum(1 for _, h in listed if h == "Healthy") == 100
    # A card the board does not know (never seen) is not offered.
    assert {h for _, h in allocation.device_list(card0, CARDS, {}, 2)} == {"Unhealthy"}


def test_allocate_for_a_card_points_at_its_uuid():
    _, card0, card1 = allocation.resources(CARDS, policy())
    assert allocation.allocate(card0, ["card-0-3", "card-0-4"], CARDS, 100).envs == {
        names.VISIBLE_DEVICES_ENV: "GPU-aaaa"}
    assert allocation.allocate(card1, ["card-1-0"], CARDS, 100).envs == {names.VISIBLE_DEVICES_ENV: "GPU-bbbb"}


def test_allocate_for_the_shares_resource_names_nothing():
    gpu = allocation.resources(CARDS, policy())[0]
    assert allocation.allocate(gpu, ["card-1-5", "card-0-7"], CARDS, 100) == allocation.Allocation()


@pytest.mark.parametrize("resource_index,device", [
    (1, "card-1-0"),      # card 1's share asked of card 0
    (1, "card-0-100"),    # past sharesPerCard
    (0, "card-2-0"),      # no such card
    (0, "nvidia0"),       # not ours at all
])
def test_allocate_refuses_ids_the_resource_never_advertised(resource_index, device):
    resource = allocation.resources(CARDS, policy())[resource_index]
    with pytest.raises(allocation.AllocationError, match=device):
        allocation.allocate(resource, [device], CARDS, 100)


def kubelet_merge(responses):
    # The kubelet keeps the first value of each key across the container's resources.
    env = {}
    for response in responses:
        for key, value in response.items():
            env.setdefault(key, value)
    return env


@pytest.mark.parametrize("card", [0, 1])
def test_a_container_with_both_resources_sees_only_its_card_in_any_merge_order(card):
    gpu, *per_card = allocation.resources(CARDS, policy())
    other = 1 - card
    responses = [
        allocation.allocate(per_card[card], [f"card-{card}-0"], CARDS, 100).envs,
        # The kubelet may hand out shares of the shares resource that name the other card.
        allocation.allocate(gpu, [f"card-{other}-0", f"card-{other}-1"], CARDS, 100).envs,
    ]
    for order in itertools.permutations(responses):
        assert kubelet_merge(order)[names.VISIBLE_DEVICES_ENV] == CARDS[card].uuid


def test_preferred_takes_required_ids_then_the_lowest_shares():
    card0 = allocation.resources(CARDS, policy())[1]
    available = ["card-0-10", "card-0-2", "card-0-9", "card-0-30", "card-0-1"]
    assert allocation.preferred(card0, available, [], 3) == ["card-0-1", "card-0-2", "card-0-9"]
    assert allocation.preferred(card0, available, ["card-0-30"], 2) == ["card-0-30", "card-0-1"]
    assert allocation.preferred(card0, available, [], 0) == []
    assert allocation.preferred(card0, ["x", "card-0-4"], [], 2) == ["card-0-4", "x"]
