"""The agent's DRA side as one piece: the node's ResourceSlice and the kubelet plugin, fed by the card board.

With ``backend: dra`` the agent serves no device plugin: the count ResourceQuota sees is in the
Node's status (nodecount.py), the scheduler picks the card from the slice, and the kubelet asks this
plugin to prepare each claim.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import kubernetes

from webhook.agent.dra import cdi, kubeletplugin, nodecount, resourcehealth, runtimechecking, slices
from webhook.agent.node import containerlimits, health, nvml, sockets
from webhook.core import asks as req
from webhook.core import draobjects, names
from webhook.core import policy as policy_mod


@dataclass(frozen=True)
class Folders:
    """Host folders the DRA side uses; the agent sees each at the same path as the kubelet and runtime do."""

    registry: str = kubeletplugin.REGISTRY_DIR
    plugins: str = kubeletplugin.PLUGINS_DIR
    cdi: str = cdi.DEFAULT_DIR

    def checkpoint(self, driver: str = names.DRA_DRIVER) -> str:
        return os.path.join(self.plugins, driver, "checkpoint.json")


class DraBackend:
    """Publishes the slice from the board's healthy cards and serves the kubelet plugin."""

    def __init__(self, api: kubernetes.client.ApiClient, node: str, devices: nvml.Devices, cards: list[nvml.Card],
                 board: health.Board, policy: policy_mod.Policy, folders: Folders = Folders(),
                 mps_root: containerlimits.MpsRoot | None = None, poll: float = 1.0, timeout: float = 10.0,
                 health_resend: float = resourcehealth.RESEND_S,
                 runtime: runtimechecking.Checker | None = None,
                 cordoned: Callable[[], frozenset[int]] = frozenset,
                 count: Callable[[str, int], nodecount.Keeper] | None = None) -> None:
        self.node = node
        # The node's container runtime must apply CDI devices, or a prepared claim's container starts without
        # its card: while it does not (or is not read yet), the slice offers no card and no claim is prepared.
        self.runtime = runtime
        if runtime is not None:
            runtime.on_change = self._runtime_changed
        # Told when the runtime's verdict changes what the Node's inventory says (the agent publishes it again).
        self.on_change: Callable[[], None] | None = None
        # The quota-able sum (the pods' gpushard.io/gpu) in the Node's status: no device plugin, so nothing for
        # the kubelet's device manager to refuse a pod over when it admits pods before the agent is back.
        self.count = count(policy.resources.shares, len(cards) * policy.shares_per_card) \
            if count is not None else None
        self.seen_node = self.count.seen if self.count is not None else None
        self.cards = list(cards)
        self.board = board
        self.policy = policy
        self.poll = poll
        self.memory_limits = devices.memory_limits_supported()
        # ``timeout``: each API request, the config's agent.requestTimeout.
        self.slices = slices.SlicePublisher(api, node, self.healthy_facts, policy.shares_per_card, timeout=timeout)
        preparer = kubeletplugin.Preparer(node, self.present_cards, policy.shares_per_card,
                                      kubeletplugin.api_claim_reader(api, timeout),
                                      kubeletplugin.Checkpoint(folders.checkpoint()),
                                      cdi_dir=folders.cdi, mode=policy.isolation, mps_root=mps_root,
                                      read_pod=kubeletplugin.api_pod_reader(api, timeout), pod_shares=self.pod_shares,
                                      refusal=self.refusal)
        self.health = resourcehealth.HealthServicer(board, self.device_health, resend=health_resend)
        self.plugin = kubeletplugin.DraPlugin(preparer, folders.registry, folders.plugins, health=self.health)
        self.cards_by_pod = preparer.cards_by_pod
        # The cards an operator cordoned (and those another plugin's pods hold): they leave the slice as an
        # unhealthy card does.
        self.cordoned = cordoned

    def pod_shares(self, pod: dict) -> int:
        """A pod's shares as gpushard counts them (its containers' gpushard.io/gpu), as the webhook did."""
        return req.effective_shares(req.read_spec(pod.get("spec") or {}, self.policy))

    def healthy_facts(self) -> list[draobjects.CardFacts]:
        """The cards the scheduler may place new claims on: present, Healthy and not cordoned.

        A cordoned card leaves the slice rather than carry a device taint: with DRADeviceTaints off (it
        is beta in 1.36, and a cluster may turn it off) the API server drops the taint and the cordon
        would hold nothing, where the scheduler alone picks the card. Claims prepared on it keep it
        (``present_cards``)."""
        if self.refusal() is not None:
            return []
        snapshot = self.board.snapshot()
        cordoned = self.cordoned()
        return [draobjects.CardFacts(c.index, c.uuid, c.model, c.memory_mib, self.policy.isolation,
                                     self.memory_limits)
                for c in self.cards if snapshot.present.get(c.index) and snapshot.healthy.get(c.index)
                and c.index not in cordoned]

    def refusal(self) -> str | None:
        """Why this node takes no new claim now, or None."""
        if self.runtime is None or self.runtime.serves():
            return None
        return self.runtime.verdict.reason

    def device_health(self, snapshot: health.Snapshot) -> list[resourcehealth.DeviceState]:
        """Every card's health for the kubelet: those in the slice Healthy, and those that left it Unhealthy
        (a claim prepared before may still hold one)."""
        return resourcehealth.card_states(self.node, self.cards, snapshot)

    def present_cards(self) -> dict[int, nvml.Card]:
        """The cards a claim may be prepared on: a card allocated before it turned Unhealthy still is."""
        present = self.board.snapshot().present
        return {c.index: c for c in self.cards if present.get(c.index)}

    def changed(self) -> None:
        self.slices.changed()

    def _runtime_changed(self) -> None:
        self.changed()
        if self.on_change is not None:
            self.on_change()

    def card_details(self) -> dict:
        """Why no claim is prepared here now, when the runtime refuses CDI devices: on every card."""
        return self.runtime.card_details() if self.runtime is not None else {}

    def sockets(self) -> list[sockets.Server]:
        return self.plugin.sockets()

    def advertised(self, cards: frozenset[int]) -> list[str]:
        """The count in the Node's status; the cards themselves are in the ResourceSlice, not the Node."""
        return [self.count.resource] if self.count is not None else []

    def unready(self) -> list[str]:
        return self.plugin.unready()

    def describe(self) -> str:
        counted = f"{self.count.resource}={self.count.count} in node {self.node!r}'s status, " \
            if self.count is not None else ""
        return f"{counted}the cards in its ResourceSlice"

    def start(self, threads: Callable[[str, object], None]) -> None:
        """Serve the plugin, then run the slice publisher and the socket keeper on ``threads(name, target)``."""
        if self.count is not None:
            # Before the DRA plugin: a pod the scheduler binds here counts on it.
            threads("gpushard-count", self.count.run)
        self.plugin.start()
        if self.runtime is not None:
            threads("gpushard-dra-runtime", self.runtime.run)
        threads("gpushard-dra-slices", self.slices.run)
        threads("gpushard-dra-plugin", lambda stop: self.plugin.run(stop, self.poll))

    def stop(self) -> None:
        self.slices.changed()  # wakes it to see the stop
        self.plugin.stop()
