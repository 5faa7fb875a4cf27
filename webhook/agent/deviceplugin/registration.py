"""Registration with the kubelet, and registering again whenever a restarting kubelet wipes our sockets."""

from __future__ import annotations

import logging
import os
import threading

import grpc

from webhook.agent.deviceplugin import server
from webhook.agent.node import sockets
from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.agent.proto import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"


def register(kubelet_socket: str, endpoint: str, resource_name: str, timeout: float = 5.0) -> None:
    """Tell the kubelet where a resource is served; raises grpc.RpcError when it will not listen."""
    request = pb.RegisterRequest(version=VERSION, endpoint=endpoint, resource_name=resource_name,
                                 options=server.OPTIONS)
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout)


class Keeper:
    """Keeps every plugin served and registered with the kubelet of the moment.

    The kubelet, when it starts, empties its device-plugin directory and then listens on a
    new kubelet.sock; it has forgotten every plugin. So each poll we restart any plugin whose
    socket is gone and register again with any kubelet.sock we have not registered with.
    """

    def __init__(self, directory: str, plugins: list[server.PluginServer], poll: float = 1.0,
                 timeout: float = 5.0) -> None:
        self.directory = directory
        self.plugins = plugins
        self.poll = poll
        self.timeout = timeout
        self.kubelet_socket = os.path.join(directory, KUBELET_SOCKET)
        self._registered: dict[str, tuple[int, int] | None] = {}
        self._failing: set[str] = set()

    def start(self) -> None:
        """Serve every resource; registration follows in ``step`` (a plugin must serve first)."""
        os.makedirs(self.directory, exist_ok=True)
        for plugin in self.plugins:
            plugin.start()

    def step(self) -> None:
        kubelet = sockets.identity(self.kubelet_socket)
        if kubelet is None:
            # The kubelet is down or still clearing the directory: restarting now would race it.
            return
        for plugin in self.plugins:
            name = plugin.resource.name
            if not plugin.socket_is_ours():
                log.info("gpushard: socket %s is gone; serving %s again", plugin.path, name)
                self._registered[name] = None  # the kubelet forgot it with its socket
                plugin.start()
            if self._registered.get(name) == kubelet:
                continue
            try:
                register(self.kubelet_socket, plugin.resource.endpoint, name, self.timeout)
            except grpc.RpcError as exc:
                if name not in self._failing:
                    log.warning("gpushard: registering %s with the kubelet failed (will retry): %s",
                                name, exc.details() if hasattr(exc, "details") else exc)
                    self._failing.add(name)
                continue
            self._failing.discard(name)
            self._registered[name] = kubelet
            log.info("gpushard: registered %s at %s", name, plugin.path)

    def unregistered(self) -> list[str]:
        """The resources the kubelet of the moment has not registered (all of them while it is down)."""
        kubelet = sockets.identity(self.kubelet_socket)
        return [p.resource.name for p in self.plugins
                if kubelet is None or self._registered.get(p.resource.name) != kubelet]

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set; the plugins keep serving until ``close``."""
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # one bad poll must not end re-registration for good
                log.exception("gpushard: checking the kubelet registration failed")
            stop.wait(self.poll)

    def close(self) -> None:
        for plugin in self.plugins:
            plugin.stop()
