"""A stand-in kubelet PodResources server (v1 ``List``) on a real unix socket, with what it lists set by tests."""

from __future__ import annotations

import threading

import grpc

from tests.agent import fakekubelet
from webhook.agent.proto import podresources_pb2 as pb
from webhook.agent.proto import podresources_pb2_grpc as pb_grpc


def container(name: str, **devices: list[str]) -> pb.ContainerResources:
    """A container with device IDs per resource name: ``container("nv", **{"nvidia.com/gpu": ["GPU-1"]})``."""
    return pb.ContainerResources(name=name, devices=[pb.ContainerDevices(resource_name=resource, device_ids=ids)
                                                     for resource, ids in devices.items()])


def shares(card: int, first: int, count: int) -> list[str]:
    return [f"card-{card}-{i}" for i in range(first, first + count)]


def gpu_container(name: str, card: int, first: int, count: int, aggregate_card: int | None = None
                  ) -> pb.ContainerResources:
    """A GPU container as gpushard's webhook makes it: shares of card ``card`` and as many of the node-wide
    resource, whose IDs the kubelet may take from another card (``aggregate_card``)."""
    other = card if aggregate_card is None else aggregate_card
    return pb.ContainerResources(name=name, devices=[
        pb.ContainerDevices(resource_name="gpushard.io/gpu", device_ids=shares(other, first, count)),
        pb.ContainerDevices(resource_name=f"gpushard.io/card-{card}", device_ids=shares(card, first, count)),
    ])


class FakePodResources:
    """Serves v1.PodResourcesLister on ``path``; ``pods`` is what List answers; ``fail`` makes it fail."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pods: list[pb.PodResources] = []
        self.fail: grpc.StatusCode | None = None
        self.calls = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def set(self, pods: list[pb.PodResources]) -> None:
        with self._lock:
            self.pods = list(pods)

    def start(self) -> FakePodResources:
        fake = self

        class Lister(pb_grpc.PodResourcesListerServicer):
            def List(self, request, context):
                with fake._lock:
                    fake.calls += 1
                    if fake.fail is not None:
                        context.abort(fake.fail, "injected failure")
                    return pb.ListPodResourcesResponse(pod_resources=fake.pods)

            def GetAllocatableResources(self, request, context):
                return pb.AllocatableResourcesResponse()

        lister = Lister()
        self._server = fakekubelet.serve_unix(
            self.path, lambda server: pb_grpc.add_PodResourcesListerServicer_to_server(lister, server))
        return self

    def stop(self) -> None:
        fakekubelet.stop_unix(self._server, self.path)
        self._server = None
