"""Cards another device plugin handed to containers that still run: not offered while any of them holds one.

A node moved from NVIDIA's device plugin to gpushard (docs/install.md, "Moving a node from NVIDIA's
device plugin") keeps the pods that plugin admitted, and their containers keep their cards. gpushard's
agent would otherwise start with every card's shares free, and a new pod would get a share of a card that a
pod of the old plugin may use whole: one card handed out twice. The kubelet's PodResources ``List`` names
every container's devices by resource; NVIDIA's plugin names a card by its UUID (or, with
``DEVICE_ID_STRATEGY=index``, by its NVML index), and a time-slicing replica as ``<id>::<n>``
(k8s-device-plugin ``internal/rm``, ``AnnotatedID``). A card whose UUID or index a container of any
resource other than gpushard's holds is withheld from new pods, as a cordoned card is (the card-k plugin
lists nothing for it), until no such container is left; pods holding its shares keep them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from webhook.agent.node import nvml
from webhook.agent.proto import podresources_pb2 as pb
from webhook.core import policy as policy_mod

log = logging.getLogger(__name__)

INTERVAL_S = 5.0
REPLICA_SEPARATOR = "::"


def held(response: pb.ListPodResourcesResponse, policy: policy_mod.Policy,
         cards: Iterable[nvml.Card]) -> dict[int, dict[str, list[str]]]:
    """{card index: {resource: ["namespace/pod", ...]}} for every card a container of another resource holds."""
    by_id = {}
    for c in cards:
        by_id[c.uuid] = by_id[str(c.index)] = c.index
    ours = policy.resources
    found: dict[int, dict[str, set[str]]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                name = devices.resource_name
                if name == ours.shares or ours.card_index(name) is not None:
                    continue
                for device in devices.device_ids:
                    card = by_id.get(device.split(REPLICA_SEPARATOR, 1)[0])
                    if card is not None:
                        found.setdefault(card, {}).setdefault(name, set()).add(f"{pod.namespace}/{pod.name}")
    return {card: {name: sorted(pods) for name, pods in sorted(per.items())} for card, per in sorted(found.items())}


class Watcher:
    """Reads the kubelet's PodResources every ``interval`` and keeps the cards other plugins' containers hold.

    ``list`` is the PodResources List call; while it fails the last answer stands (a card is neither
    withdrawn nor offered on a kubelet that does not answer), and nothing is withheld before a first answer.
    """

    def __init__(self, list_call: Callable[[], pb.ListPodResourcesResponse], policy: policy_mod.Policy,
                 cards: Iterable[nvml.Card], interval: float = INTERVAL_S) -> None:
        self._list = list_call
        self.policy = policy
        self.cards = list(cards)
        self.interval = interval
        self.found: dict[int, dict[str, list[str]]] = {}
        self.on_change: Callable[[], None] | None = None
        self._failing = False

    @property
    def withheld(self) -> frozenset[int]:
        return frozenset(self.found)

    def check(self) -> bool:
        """Read once; True when the cards held changed."""
        try:
            response = self._list()
        except Exception as exc:  # a kubelet restarting, or no PodResources socket
            if not self._failing:
                log.warning("gpushard: cannot read which cards other device plugins' pods hold (will retry): %s",
                            exc)
            self._failing = True
            return False
        self._failing = False
        found = held(response, self.policy, self.cards)
        if found == self.found:
            return False
        for card in sorted(set(found) | set(self.found)):
            if card in found:
                pods = "; ".join(f"{name}: {', '.join(who)}" for name, who in found[card].items())
                log.warning("gpushard: card %d is held by pods of another device plugin (%s): its shares are not "
                            "offered until they end", card, pods)
            else:
                log.info("gpushard: card %d is no longer held by another device plugin's pods: its shares are "
                         "offered", card)
        self.found = found
        return True

    def card_details(self) -> dict[int, dict]:
        """What each withheld card's inventory entry says: ``heldBy``, the other resource and its pods."""
        return {card: {"heldBy": per} for card, per in self.found.items()}

    def run(self, stop: threading.Event) -> None:
        while True:
            if self.check() and self.on_change is not None:
                self.on_change()
            if stop.wait(self.interval):
                return
