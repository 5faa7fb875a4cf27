"""The kubelet's side of DRA, built from our copies of the published protos, over real unix sockets.

It plays the plugin watcher (dial the registration socket, GetInfo, check type and version, dial the
endpoint, NotifyRegistrationStatus) and the kubelet's DRA manager (NodePrepareResources and
NodeUnprepareResources with claims named by namespace, UID and name, and the NodeWatchResources
health stream it keeps open on the same endpoint). The health service is chosen as kubelet 1.37 chooses
it: the first of the kubelet's own list that the plugin advertises among its supported versions, none when
it advertises none (cm/dra/plugin/dra_plugin_manager.go, pickHealthService); 1.36 called v1alpha1 unasked.
"""

from __future__ import annotations

import threading
import time

import grpc

from webhook.agent.proto import dra_health_pb2 as hpb
from webhook.agent.proto import dra_pb2 as dpb
from webhook.agent.proto import dra_pb2_grpc as dpb_grpc
from webhook.agent.proto import pluginregistration_pb2 as rpb
from webhook.agent.proto import pluginregistration_pb2_grpc as rpb_grpc

TIMEOUT = 10.0
# The kubelet's health services, newest first (kubelet 1.37, healthServicesSupportedByKubelet).
KUBELET_HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


class RegistrationRefused(AssertionError):
    """What the kubelet would log and tell the plugin for a plugin it will not use."""


class DraKubelet:
    def __init__(self) -> None:
        self.endpoint: str | None = None
        self.driver: str | None = None
        self.versions: list[str] = []

    def register(self, registration_socket: str) -> rpb.PluginInfo:
        """Register as the plugin watcher does; the plugin hears the outcome through NotifyRegistrationStatus."""
        with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
            stub = rpb_grpc.RegistrationStub(channel)
            info = stub.GetInfo(rpb.InfoRequest(), timeout=TIMEOUT)
            problem = ""
            if info.type != "DRAPlugin":
                problem = f"plugin type {info.type!r} is not DRAPlugin"
            elif "v1.DRAPlugin" not in info.supported_versions:
                problem = f"none of the versions {list(info.supported_versions)} is v1.DRAPlugin"
            elif not info.endpoint:
                problem = "no endpoint"
            stub.NotifyRegistrationStatus(rpb.RegistrationStatus(plugin_registered=not problem, error=problem),
                                          timeout=TIMEOUT)
            if problem:
                raise RegistrationRefused(problem)
        self.endpoint, self.driver, self.versions = info.endpoint, info.name, list(info.supported_versions)
        return info

    def health_service(self) -> str | None:
        """What a 1.37 kubelet would open: the first of its services the plugin advertised, else none."""
        return next((s for s in KUBELET_HEALTH_SERVICES if s in self.versions), None)

    def _stub(self, channel) -> dpb_grpc.DRAPluginStub:
        return dpb_grpc.DRAPluginStub(channel)

    def prepare(self, *claims: tuple[str, str, str]) -> dpb.NodePrepareResourcesResponse:
        """NodePrepareResources for (namespace, uid, name) claims."""
        request = dpb.NodePrepareResourcesRequest(claims=[dpb.Claim(namespace=n, uid=u, name=m) for n, u, m in claims])
        with grpc.insecure_channel(f"unix://{self.endpoint}") as channel:
            return self._stub(channel).NodePrepareResources(request, timeout=TIMEOUT)

    def unprepare(self, *claims: tuple[str, str, str]) -> dpb.NodeUnprepareResourcesResponse:
        request = dpb.NodeUnprepareResourcesRequest(
            claims=[dpb.Claim(namespace=n, uid=u, name=m) for n, u, m in claims])
        with grpc.insecure_channel(f"unix://{self.endpoint}") as channel:
            return self._stub(channel).NodeUnprepareResources(request, timeout=TIMEOUT)

    def watch_health(self, service: str | None = None) -> HealthStream:
        """NodeWatchResources on the plugin's endpoint, as the kubelet opens it after registration: under the
        service it negotiated, or ``service`` (as 1.36 called v1alpha1 whatever was advertised)."""
        chosen = service or self.health_service()
        if chosen is None:
            raise AssertionError(f"a 1.37 kubelet opens no health stream: the plugin advertised {self.versions}")
        return HealthStream(self.endpoint, chosen)


class HealthStream:
    """An open NodeWatchResources stream read on a thread; each message is kept with when it came."""

    def __init__(self, endpoint: str, service: str = "v1alpha1.DRAResourceHealth") -> None:
        self.channel = grpc.insecure_channel(f"unix://{endpoint}")
        # The method path carries the service's package; the messages are the same under v1 and v1alpha1.
        watch = self.channel.unary_stream(f"/{service}/NodeWatchResources",
                                          request_serializer=hpb.NodeWatchResourcesRequest.SerializeToString,
                                          response_deserializer=hpb.NodeWatchResourcesResponse.FromString)
        self.call = watch(hpb.NodeWatchResourcesRequest())
        self.messages: list[tuple[float, hpb.NodeWatchResourcesResponse]] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._cond:
                    self.messages.append((time.monotonic(), message))
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def message(self, number: int, timeout: float = TIMEOUT) -> hpb.NodeWatchResourcesResponse:
        """The ``number``-th message (from 0), waiting up to ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.messages) > number or self.ended.is_set(), timeout):
                raise AssertionError(f"NodeWatchResources message {number} did not come within {timeout}s")
            if len(self.messages) <= number:
                raise AssertionError(f"NodeWatchResources ended before message {number}: {self.error}")
            return self.messages[number][1]

    def close(self) -> None:
        """Hang up, as a kubelet that stops or restarts does."""
        self.call.cancel()
        self.channel.close()


def health_by_device(message: hpb.NodeWatchResourcesResponse) -> dict[tuple[str, str], str]:
    """(pool, device) -> HEALTHY, UNHEALTHY or UNKNOWN, as the kubelet reads a message."""
    return {(d.device.pool_name, d.device.device_name): hpb.HealthStatus.Name(d.health) for d in message.devices}
