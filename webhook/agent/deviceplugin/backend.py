"""The agent's device-plugin backend as one piece: a gRPC server per resource, kept registered with the kubelet.

With ``backend: deviceplugin`` the kubelet's device manager counts the node-wide resource (gpushard.io/gpu)
and each card's (gpushard.io/card-<k>), and calls Allocate on the card's plugin for each container.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from webhook.agent.deviceplugin import holders, registration, server
from webhook.agent.node import allocation, containerlimits, health, nvml, podresources, sockets
from webhook.core import policy as policy_mod


class DevicePluginBackend:
    """Serves each resource's plugin and keeps it registered with the kubelet of the moment."""

    # PodResources names each container's card under this backend
    cards_by_pod: Callable[[], Mapping[tuple[str, str], int]] | None = None
    seen_node: Callable[[dict | None], None] | None = None  # nothing of the Node is needed
    on_change: Callable[[], None] | None = None  # its card_details never change

    def __init__(self, directory: str, cards: list[nvml.Card], board: health.Board, policy: policy_mod.Policy,
                 mps_root: containerlimits.MpsRoot, cordoned: Callable[[], frozenset[int]],
                 pod_resources: podresources.Client | None = None, poll: float = 1.0, tick: float = 1.0,
                 register_timeout: float = 5.0, holders_refresh: float = holders.REFRESH_S) -> None:
        self.policy = policy
        self.resources = allocation.resources(cards, policy)
        limits = containerlimits.Limits(policy.isolation, policy.shares_per_card, mps_root) \
            if policy.isolation != "none" else None
        # The node-wide resource's IDs take the health of the card their container is on, which the kubelet's
        # PodResources tells; without it they stay Healthy.
        self.pod_resources = pod_resources
        self.share_holders = holders.Holders(self._read_share_holders if pod_resources is not None else None,
                                             refresh=holders_refresh)
        self.plugins = [server.PluginServer(directory, r, cards, board, policy.shares_per_card, tick,
                                            strategy=policy.device_list_strategy, limits=limits,
                                            share_holders=self.share_holders if r.card_index is None else None,
                                            cordoned=cordoned)
                        for r in self.resources]
        self.keeper = registration.Keeper(directory, self.plugins, poll=poll, timeout=register_timeout)
        self.directory = directory

    def _read_share_holders(self) -> dict[str, int | None]:
        assert self.pod_resources is not None  # the holders read only with a PodResources client
        return self.pod_resources.share_holders(self.policy)

    def describe(self) -> str:
        return f"serving {', '.join(r.name for r in self.resources)} in {self.directory}"

    def start(self, threads: Callable[[str, Callable[[threading.Event], None]], None]) -> None:
        """Serve every resource (OSError when a socket cannot be bound), then keep them registered."""
        if self.plugins:
            self.keeper.start()
            threads("gpushard-kubelet", self.keeper.run)

    def changed(self) -> None:
        """Nothing to do: each plugin's stream lists again when the card board changes."""
        return None

    def card_details(self) -> dict:
        return {}

    def sockets(self) -> list[sockets.Server]:
        return [p.socket for p in self.plugins]

    def advertised(self, cards: frozenset[int]) -> list[str]:
        """The node-wide resource and those of ``cards``: what the Node's allocatable shows once registered."""
        return [r.name for r in self.resources if r.card_index is None or r.card_index in cards]

    def unready(self) -> list[str]:
        waiting = self.keeper.unregistered() if self.plugins else []
        return [f"the kubelet has not registered {', '.join(waiting)} yet"] if waiting else []

    def stop(self) -> None:
        self.keeper.close()
