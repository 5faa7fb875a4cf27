"""The kubelet's device-plugin gRPC service for one resource, on its own unix socket."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator

import grpc

from webhook.agent.deviceplugin import holders
from webhook.agent.node import allocation, containerlimits, health, nvml, sockets
from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.agent.proto import deviceplugin_pb2_grpc as pb_grpc
from webhook.core import policy as policy_mod

log = logging.getLogger(__name__)

OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def container_response(answer: allocation.Allocation) -> pb.ContainerAllocateResponse:
    """The kubelet's message for one container's allocation."""
    return pb.ContainerAllocateResponse(
        envs=answer.envs,
        mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                for m in answer.mounts],
        cdi_devices=[pb.CDIDevice(name=name) for name in answer.cdi_devices])


class Servicer(pb_grpc.DevicePluginServicer):
    """Answers the kubelet for one resource from the board's state."""

    def __init__(self, resource: allocation.Resource, cards: list[nvml.Card], board: health.Board,
                 shares_per_card: int, tick: float = 1.0,
                 strategy: tuple[str, ...] = policy_mod.DEFAULT_DEVICE_LIST_STRATEGY,
                 limits: containerlimits.Limits | None = None, share_holders: holders.Holders | None = None,
                 cordoned: Callable[[], frozenset[int]] = frozenset) -> None:
        self.resource = resource
        self.strategy = strategy
        # Only the node-wide resource's list depends on who holds its IDs; none at all for a card's.
        self.holders = (share_holders or holders.Holders(None)) if resource.card_index is None else None
        self.limits = limits
        self.cordoned = cordoned  # the card indexes an operator cordoned now
        self.cards = list(cards)
        self.board = board
        self.shares_per_card = shares_per_card
        self.tick = tick
        self._stopped = threading.Event()

    def stop(self) -> None:
        """End every open ListAndWatch stream (cleanly, with status OK)."""
        self._stopped.set()
        self.board.poke()

    def _devices(self, snapshot: health.Snapshot) -> list[pb.Device]:
        if self.holders is None:
            listed = allocation.device_list(self.resource, self.cards, snapshot.healthy, self.shares_per_card)
        else:
            held = self.holders.held(snapshot.version)
            listed = allocation.device_list(self.resource, self.cards, snapshot.healthy, self.shares_per_card, held)
            alone = allocation.device_list(self.resource, self.cards, snapshot.healthy, self.shares_per_card)
            self.holders.listed(listed, depends=listed != alone, healthy=allocation.HEALTHY)
        return [pb.Device(ID=device, health=state) for device, state in listed]

    def _offered(self, devices: list[pb.Device]) -> list[pb.Device]:
        """What the stream lists: nothing for a card an operator cordoned.

        Withdrawn rather than Unhealthy: the kubelet then counts neither capacity nor allocatable for
        the card, so no new pod fits; pods holding its IDs keep them (the kubelet's checkpoint, not this
        list, is what a restarted container gets its devices from), and their status keeps saying
        Healthy, as the kubelet reports an ID it no longer lists (docs/agent.md, "A card in maintenance").
        The node-wide shares resource keeps listing the card: its IDs name no card, and the pods on it
        hold some of them.
        """
        if self.resource.card_index is not None and self.resource.card_index in self.cordoned():
            return []
        return devices

    def GetDevicePluginOptions(self, request, context):
        return OPTIONS

    def ListAndWatch(self, request, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        # The kubelet keeps this stream open for the plugin's life and reads each message
        # as the full device list; send one at once and another whenever ours changes.
        def interrupted() -> bool:
            return self._stopped.is_set() or not context.is_active()

        context.add_callback(self.board.poke)  # a kubelet that hangs up wakes us at once
        seen: int | None = None
        sent: list[pb.Device] | None = None
        while not interrupted():
            snapshot = self.board.wait_change(seen, self.tick, interrupted)
            if snapshot is None:
                if self.holders is None or interrupted():
                    continue
                # The node-wide list also follows who holds its IDs, which moves without the board.
                snapshot = self.board.snapshot()
            if snapshot.closed:
                return
            seen = snapshot.version
            devices = self._offered(self._devices(snapshot))
            if devices != sent:
                sent = devices
                yield pb.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(self, request, context):
        responses = [pb.ContainerPreferredAllocationResponse(deviceIDs=allocation.preferred(
            self.resource, req.available_deviceIDs, req.must_include_deviceIDs, req.allocation_size))
            for req in request.container_requests]
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request, context):
        responses = []
        for req in request.container_requests:
            try:
                answer = allocation.allocate(self.resource, req.devices_ids, self.cards, self.shares_per_card,
                                             self.strategy)
            except allocation.AllocationError as exc:
                log.warning("%s", exc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if self.holders is not None:
                self.holders.allocated(req.devices_ids)
            if self.limits is not None:
                answer = allocation.combined(answer, self.limits.for_request(self.resource, req.devices_ids,
                                                                               self.cards))
            responses.append(container_response(answer))
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()



class PluginServer:
    """One resource's gRPC server on ``<directory>/<endpoint>``; restartable after the kubelet wipes it."""

    def __init__(self, directory: str, resource: allocation.Resource, cards: list[nvml.Card],
                 board: health.Board, shares_per_card: int, tick: float = 1.0, workers: int = 8,
                 strategy: tuple[str, ...] = policy_mod.DEFAULT_DEVICE_LIST_STRATEGY,
                 limits: containerlimits.Limits | None = None, share_holders: holders.Holders | None = None,
                 cordoned: Callable[[], frozenset[int]] = frozenset) -> None:
        self.directory = directory
        self.resource = resource
        if resource.card_index is None and share_holders is None:
            share_holders = holders.Holders(None)  # one for every start: what Allocate handed out outlives a restart
        self._servicer_args = (resource, list(cards), board, shares_per_card, tick, strategy, limits, share_holders,
                               cordoned)
        self.servicer: Servicer | None = None
        # Each ListAndWatch stream holds a worker for its whole life; leave room for the unary calls.
        self.socket = sockets.Server(os.path.join(directory, resource.endpoint), self._add, workers,
                                     name=f"dp-{resource.endpoint}")

    def _add(self, server: grpc.Server) -> None:
        # A fresh servicer per start: the old one's streams are ended and stay ended.
        self.servicer = Servicer(*self._servicer_args)
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)

    @property
    def path(self) -> str:
        return self.socket.path

    @property
    def identity(self) -> tuple[int, int] | None:
        return self.socket.identity

    def start(self) -> None:
        """Serve on a fresh socket, replacing any stale file left by an earlier run."""
        self.stop()
        self.socket.start()

    def socket_is_ours(self) -> bool:
        """False once the socket file is gone or replaced, as a restarting kubelet does."""
        return self.socket.is_ours()

    def stop(self, grace: float = 1.0) -> None:
        """Close the streams, stop serving, and remove our socket (only if it is still ours)."""
        if not self.socket.serving:
            return
        assert self.servicer is not None  # serving: _add made one
        self.servicer.stop()
        self.socket.stop(grace)
