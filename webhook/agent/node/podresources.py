"""Which container holds which shares of which card, from the kubelet's PodResources API (v1 ``List``)."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from webhook.agent.node import allocation
from webhook.agent.proto import podresources_pb2 as pb
from webhook.agent.proto import podresources_pb2_grpc as pb_grpc
from webhook.core import policy as policy_mod

SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
TIMEOUT_S = 5.0


class PodResourcesError(RuntimeError):
    """The kubelet's PodResources API did not answer."""


@dataclass(frozen=True)
class Holding:
    """One container's shares of one card."""

    namespace: str
    pod: str
    container: str
    card: int
    shares: int


def holdings(response: pb.ListPodResourcesResponse, policy: policy_mod.Policy) -> list[Holding]:
    """The card shares in a List answer. Only ``<cardPrefix><k>`` counts: the kubelet picks the IDs
    of the node-wide ``gpushard.io/gpu`` without knowing the container's card, so those name no card."""
    found = []
    for pod in response.pod_resources:
        for container in pod.containers:
            per_card: dict[int, int] = {}
            for devices in container.devices:
                card = policy.resources.card_index(devices.resource_name)
                if card is None:
                    continue
                ids = [allocation.parse_device_id(d) for d in devices.device_ids]
                per_card[card] = per_card.get(card, 0) + sum(1 for i in ids if i is not None and i[0] == card)
            found += [Holding(pod.namespace, pod.name, container.name, card, shares)
                      for card, shares in sorted(per_card.items()) if shares > 0]
    return found


def dra_holdings(response: pb.ListPodResourcesResponse, cards_by_pod: Mapping[tuple[str, str], int],
                 shares_of: Callable[[str, str], Mapping[str, int] | None]) -> list[Holding]:
    """The card shares in a List answer under backend dra: each listed container's shares as its pod asks
    them (``shares_of``: container name -> its gpushard.io/gpu, from the pod's spec; the count is in the Node's
    status, served by no device plugin, so PodResources lists no ID of it), on the card of the claim prepared
    for its pod (``cards_by_pod``, from the DRA plugin's checkpoint). A pod with no claim prepared here holds
    nothing we can place."""
    found = []
    for pod in response.pod_resources:
        card = cards_by_pod.get((pod.namespace, pod.name))
        if card is None:
            continue
        asked = shares_of(pod.namespace, pod.name) or {}
        for container in pod.containers:
            shares = asked.get(container.name, 0)
            if shares > 0:
                found.append(Holding(pod.namespace, pod.name, container.name, card, shares))
    return found


def share_holders(response: pb.ListPodResourcesResponse, policy: policy_mod.Policy) -> dict[str, int | None]:
    """Each ID of the node-wide ``gpushard.io/gpu`` that a container holds, with that container's card: the
    card of its ``<cardPrefix><k>`` IDs. None where no single card is known (a container holding shares of no
    card, or of several)."""
    found: dict[str, int | None] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ids = [i for d in container.devices if d.resource_name == policy.resources.shares for i in d.device_ids]
            if not ids:
                continue
            cards = {policy.resources.card_index(d.resource_name) for d in container.devices if d.device_ids}
            cards.discard(None)
            card = cards.pop() if len(cards) == 1 else None
            found.update(dict.fromkeys(ids, card))
    return found


class Client:
    """A client of the kubelet's PodResources socket; the channel reconnects when the kubelet restarts."""

    def __init__(self, socket: str = SOCKET, timeout: float = TIMEOUT_S) -> None:
        self.socket = socket
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None

    def _stub(self) -> pb_grpc.PodResourcesListerStub:
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(f"unix://{self.socket}")
            return pb_grpc.PodResourcesListerStub(self._channel)

    def list(self) -> pb.ListPodResourcesResponse:
        try:
            return self._stub().List(pb.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise PodResourcesError(f"PodResources List on {self.socket}: {exc.code().name} {exc.details()}") \
                from None

    def holdings(self, policy: policy_mod.Policy,
                 cards_by_pod: Callable[[], Mapping[tuple[str, str], int]] | None = None,
                 shares_of: Callable[[str, str], Mapping[str, int] | None] | None = None) -> builtins.list[Holding]:
        """The card shares held on the node; with ``cards_by_pod`` and ``shares_of`` (backend dra), from the
        prepared claims and the pods' asks (:func:`dra_holdings`)."""
        if cards_by_pod is not None:
            return dra_holdings(self.list(), cards_by_pod(), shares_of or (lambda _namespace, _pod: None))
        return holdings(self.list(), policy)

    def share_holders(self, policy: policy_mod.Policy) -> dict[str, int | None]:
        """Who holds which ID of the node-wide resource, on which card (:func:`share_holders`)."""
        return share_holders(self.list(), policy)

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
