"""We test the node-wide shares resource's list and who holds its IDs, as plain data and with a stand-in clock:
- its IDs name no card, parse back, stay under the kubelet's 63 characters, and a card's resource refuses them;
- the list: sharesPerCard IDs per card; held IDs take their container's card's health (Healthy when not known);
  the others are Healthy lowest first until sharesPerCard x healthy cards are; a held ID from outside the pool
  stays listed; the preferred allocation takes the lowest by number;
- PodResources to holders: a container's card from its card resource; none when a container holds shares of
  no card or of several (under backend dra there is no such resource: its count is in the Node's status);
- when PodResources is read: once per board version, again when Allocate hands out an ID not listed Healthy,
  every refresh only while the list depends on the holders; recent Allocate IDs count as held for the grace;
  while it fails, every ID handed out since start counts as held on no known card.
"""

import pytest

from webhook import settings
from webhook.agent.deviceplugin import holders
from webhook.agent.node import allocation, nvml, podresources
from webhook.agent.proto import podresources_pb2 as pb

CARDS = [nvml.Card(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559),
         nvml.Card(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 81559)]
H, U = allocation.HEALTHY, allocation.UNHEALTHY


def policy(**data):
    return settings.from_mapping(data).policy


@pytest.mark.parametrize("number", [0, 7, 10 ** 9])
def test_pool_ids_name_no_card_and_parse_back(number):
    device = allocation.pool_id(number)
    assert len(device) <= allocation.MAX_DEVICE_ID
    assert allocation.parse_pool_id(device) == number
    assert allocation.parse_device_id(device) is None
    assert allocation.parse_pool_id(allocation.device_id(1, number)) is None


def test_a_card_resource_refuses_pool_ids_and_the_sum_takes_both_kinds():
    gpu, card0, _ = allocation.resources(CARDS, policy())
    with pytest.raises(allocation.AllocationError, match="share-1"):
        allocation.allocate(card0, ["share-1"], CARDS, 4)
    assert allocation.allocate(gpu, ["share-1", "card-1-2"], CARDS, 4) == allocation.Allocation()
    for outside in ("share-x", "share-8"):  # 2 cards x 4 shares: share-0 ... share-7
        with pytest.raises(allocation.AllocationError, match=outside):
            allocation.allocate(gpu, [outside], CARDS, 4)


def test_the_list_with_nobody_holding():
    gpu = allocation.resources(CARDS, policy())[0]
    assert allocation.device_list(gpu, CARDS, {0: True, 1: True}, 2) == [
        ("share-0", H), ("share-1", H), ("share-2", H), ("share-3", H)]
    assert allocation.device_list(gpu, CARDS, {0: True, 1: False}, 2) == [
        ("share-0", H), ("share-1", H), ("share-2", U), ("share-3", U)]
    assert allocation.device_list(gpu, CARDS, {}, 2) == [(f"share-{n}", U) for n in range(4)]


def test_held_ids_follow_their_container_s_card():
    healthy = {0: True, 1: False}
    held = {"share-0": 1, "share-3": 0, "share-5": None}
    listed = dict(allocation.pool_list(6, 3, held, healthy))
    assert (listed["share-0"], listed["share-3"], listed["share-5"]) == (U, H, H)
    # Two held IDs are Healthy; one more of the free ones, the lowest.
    assert [d for d, h in listed.items() if h == H] == ["share-1", "share-3", "share-5"]
    # More held on healthy or unknown cards than the count: every one stays Healthy and listed.
    many = dict(allocation.pool_list(4, 1, {"share-2": 0, "share-3": None}, healthy))
    assert many == {"share-0": U, "share-1": U, "share-2": H, "share-3": H}


def test_a_held_id_from_outside_the_pool_stays_listed():
    listed = allocation.pool_list(2, 2, {"card-1-7": 0, "share-9": 1}, {0: True, 1: False})
    assert listed == [("share-0", H), ("share-1", U), ("share-9", U), ("card-1-7", H)]


def test_preferred_takes_the_lowest_pool_ids_by_number():
    gpu = allocation.resources(CARDS, policy())[0]
    assert allocation.preferred(gpu, ["share-10", "share-2", "share-9"], [], 2) == ["share-2", "share-9"]


def response(*pods):
    return pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(name=name, namespace="ns", containers=[
            pb.ContainerResources(name=c, devices=[pb.ContainerDevices(resource_name=r, device_ids=ids)
                                                   for r, ids in devices.items()])
            for c, devices in containers.items()])
        for name, containers in pods])


def test_holders_from_pod_resources_under_the_device_plugin():
    answer = response(
        ("a", {"main": {"gpushard.io/gpu": ["share-0", "share-1"], "gpushard.io/card-1": ["card-1-0", "card-1-1"]},
               "side": {"gpushard.io/gpu": ["share-2"], "gpushard.io/card-1": ["card-1-2"]}}),
        ("b", {"odd": {"gpushard.io/gpu": ["share-3"]},
               "two": {"gpushard.io/gpu": ["share-4"], "gpushard.io/card-0": ["card-0-0"],
                       "gpushard.io/card-1": ["card-1-3"]},
               "none": {"gpushard.io/card-0": ["card-0-1"], "nvidia.com/gpu": ["GPU-x"]}}))
    assert podresources.share_holders(answer, policy()) == {
        "share-0": 1, "share-1": 1, "share-2": 1, "share-3": None, "share-4": None}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Reader:
    def __init__(self, answer=None):
        self.answer = answer or {}
        self.calls = 0
        self.fail = False

    def __call__(self):
        self.calls += 1
        if self.fail:
            raise podresources.PodResourcesError("PodResources List on x: UNAVAILABLE")
        return dict(self.answer)


def test_reads_once_per_board_version_and_refreshes_only_when_the_list_depends_on_them():
    clock, read = Clock(), Reader({"share-0": 1})
    book = holders.Holders(read, refresh=5, clock=clock)
    assert book.held(1) == {"share-0": 1} and read.calls == 1
    assert book.held(1) == {"share-0": 1} and read.calls == 1
    clock.now += 60
    book.listed([("share-0", H)], depends=False, healthy=H)
    assert book.held(1) and read.calls == 1  # all cards fine: who holds what changes nothing
    book.listed([("share-0", U)], depends=True, healthy=H)
    book.held(1)
    assert read.calls == 2
    clock.now += 1
    book.held(1)
    assert read.calls == 2
    clock.now += 5
    book.held(1)
    assert read.calls == 3
    book.held(2)
    assert read.calls == 4


def test_an_id_handed_out_off_the_healthy_list_is_read_again_and_held_for_the_grace():
    clock, read = Clock(), Reader()
    book = holders.Holders(read, grace=10, clock=clock)
    book.held(1)
    book.listed([("share-0", H), ("share-1", U)], depends=True, healthy=H)
    book.allocated(["share-0"])
    assert book.held(1) == {"share-0": None} and read.calls == 1  # on the list: nothing to look at yet
    book.allocated(["share-1"])
    assert book.held(1) == {"share-0": None, "share-1": None} and read.calls == 2
    read.answer = {"share-1": 0}
    clock.now += 11
    book.held(2)
    # share-1 seen by the kubelet; share-0 never was, and its grace is over: released.
    assert book.held(2) == {"share-1": 0}


def test_while_pod_resources_fails_every_id_handed_out_counts():
    clock, read = Clock(), Reader({"share-0": 1})
    book = holders.Holders(read, refresh=5, clock=clock)
    book.allocated(["share-0", "share-3"])
    read.fail = True
    assert book.held(1) == {"share-0": None, "share-3": None}
    clock.now += 5
    read.fail = False
    # Retried every refresh while failing, and back; share-3, which the List lacks, is held until its grace ends.
    assert book.held(1) == {"share-0": 1, "share-3": None}
    clock.now += 11
    book.listed([("share-0", U)], depends=True, healthy=H)
    assert book.held(1) == {"share-0": 1}
    assert holders.Holders(None).held(1) == {}
