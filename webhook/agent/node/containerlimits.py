"""Each container's limits at Allocate, as plain data: env and mounts from its card, its shares and the mode.

The card-k plugin knows the card and the container's shares (the number of device IDs it was
given), so no pod is looked up. Nothing here knows gRPC; the servicer translates the answer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from webhook.agent.node import allocation, nvml
from webhook.core import isolation, names

log = logging.getLogger(__name__)

DEFAULT_MPS_ROOT = "/run/gpushard/mps"


@dataclass(frozen=True)
class MpsRoot:
    """The host folder under which each card's MPS daemon keeps its pipe and log folders.

    The agent sees it at the same path as the host (its DaemonSet mounts it so), because the
    paths it hands the kubelet in Allocate are host paths.
    """

    path: str = DEFAULT_MPS_ROOT

    def card_dir(self, card: nvml.Card) -> str:
        # By UUID: a card keeps its folder even if the driver numbers the cards differently after a reboot.
        return os.path.join(self.path, card.uuid)

    def pipe_dir(self, card: nvml.Card) -> str:
        return os.path.join(self.card_dir(card), "pipe")

    def log_dir(self, card: nvml.Card) -> str:
        return os.path.join(self.card_dir(card), "log")

    @property
    def shm_dir(self) -> str:
        # MPS clients and their server share POSIX shared memory, so every client gets this folder as
        # /dev/shm, and so does the agent, whose daemons start the servers (see docs/isolation.md).
        return os.path.join(self.path, "shm")


def answer(card: nvml.Card, shares: int, shares_per_card: int, mode: str,
           mps: MpsRoot | None = None) -> allocation.Allocation:
    """The limits of a container holding ``shares`` of ``card`` under isolation ``mode``."""
    if mode == isolation.NONE or shares <= 0:
        return allocation.Allocation()
    cap = isolation.memory_cap_mib(shares, card.memory_mib, shares_per_card)
    if card.memory_mib <= 0:
        # An inventory without memory (a fake card): a cap of 0 MiB would stop the container from running.
        log.warning("gpushard: card %d (%s) reports no memory size; its containers get no memory cap",
                    card.index, card.uuid)
    if mode == isolation.MEMORY:
        if card.memory_mib <= 0:
            return allocation.Allocation()
        # The toolkit's hook reads both in whole MiB; the request is the soft limit it guarantees. The plural
        # names too: one revision of the hook reads them before the singular ones, and an image could set them.
        return allocation.Allocation({names.GPU_MEMORY_LIMIT_ENV: str(cap), names.GPU_MEMORY_REQUEST_ENV: str(cap),
                                      names.GPU_MEMORY_LIMITS_ENV: str(cap), names.GPU_MEMORY_REQUESTS_ENV: str(cap)})
    if mode == isolation.MPS:
        mps = mps or MpsRoot()
        envs = {names.MPS_PIPE_DIRECTORY_ENV: names.MPS_CLIENT_PIPE_DIR,
                names.MPS_THREAD_PERCENTAGE_ENV: str(isolation.thread_percentage(shares, shares_per_card))}
        if card.memory_mib > 0:
            # The container sees one GPU (its card), so to CUDA inside it the card is device 0.
            envs[names.MPS_PINNED_MEMORY_ENV] = f"0={cap}M"
        return allocation.Allocation(envs, (
            allocation.Mount(container_path=names.MPS_CLIENT_PIPE_DIR, host_path=mps.pipe_dir(card)),
            allocation.Mount(container_path=names.MPS_CLIENT_SHM_DIR, host_path=mps.shm_dir)))
    raise ValueError(f"gpushard: unknown isolation mode {mode!r}")


class Limits:
    """The isolation answer for Allocate requests of one node's resources."""

    def __init__(self, mode: str, shares_per_card: int, mps: MpsRoot | None = None) -> None:
        self.mode = mode
        self.shares_per_card = shares_per_card
        self.mps = mps or MpsRoot()

    def for_request(self, resource: allocation.Resource, devices: Iterable[str],
                    cards: Iterable[nvml.Card]) -> allocation.Allocation:
        """The answer for one container's request of ``resource`` (already checked by the allocation).

        The node-wide shares resource answers nothing: the kubelet merges every resource's answer,
        and that resource's share IDs say nothing about the card.
        """
        if resource.card_index is None:
            return allocation.Allocation()
        card = next((c for c in cards if c.index == resource.card_index), None)
        if card is None:
            return allocation.Allocation()
        return answer(card, len(set(devices)), self.shares_per_card, self.mode, self.mps)
