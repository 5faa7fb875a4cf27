"""A fake kubelet on the wire: a real Registration gRPC server on a unix socket, and the kubelet's client side."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from concurrent import futures

import grpc

from webhook.agent.proto import deviceplugin_pb2 as pb
from webhook.agent.proto import deviceplugin_pb2_grpc as pb_grpc

KUBELET_SOCKET = "kubelet.sock"


def short_tempdir(prefix: str = "gsa-") -> str:
    """A folder under /tmp: unix socket paths must stay under about 100 characters."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def serve_unix(path: str, add_servicer) -> grpc.Server:
    """A started gRPC server on unix socket ``path``, with ``add_servicer(server)`` applied."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_servicer(server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def stop_unix(server: grpc.Server | None, path: str) -> None:
    """Stop a server of ``serve_unix`` (None: nothing to stop) and remove its socket."""
    if server is not None:
        server.stop(0).wait(2)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class FakeKubelet:
    """Serves v1beta1.Registration on <directory>/kubelet.sock and records every RegisterRequest.

    Like the real kubelet, it dials the plugin's endpoint as soon as a plugin registers and asks for its
    options. A plugin that does not answer yet is refused with an error and noted in ``refused``; the
    real kubelet would have dropped it for good, so ``wait_for`` fails on any refusal.
    """

    def __init__(self, directory: str, dial_timeout: float = 1.0) -> None:
        self.directory = directory
        self.path = os.path.join(directory, KUBELET_SOCKET)
        self.dial_timeout = dial_timeout
        self.requests: list[pb.RegisterRequest] = []
        self.refused: list[tuple[pb.RegisterRequest, str]] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None

    def _options(self, request: pb.RegisterRequest) -> str | None:
        """Why the plugin behind ``request`` cannot be used, or None when it answers."""
        endpoint = os.path.join(self.directory, request.endpoint)
        try:
            with grpc.insecure_channel(f"unix://{endpoint}") as channel:
                pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=self.dial_timeout)
        except grpc.RpcError as exc:
            return f"cannot reach {endpoint}: {exc.code().name} {exc.details()}"
        return None

    def start(self) -> FakeKubelet:
        fake = self

        class Registration(pb_grpc.RegistrationServicer):
            def Register(self, request, context):
                problem = fake._options(request)
                with fake._cond:
                    fake.requests.append(request)
                    if problem is not None:
                        fake.refused.append((request, problem))
                    fake._cond.notify_all()
                if problem is not None:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
                return pb.Empty()

        self._server = serve_unix(self.path, lambda server: pb_grpc.add_RegistrationServicer_to_server(
            Registration(), server))
        return self

    def stop(self) -> None:
        stop_unix(self._server, self.path)
        self._server = None

    def wait_for(self, resource_names: set[str], timeout: float = 5.0) -> dict[str, pb.RegisterRequest]:
        """The latest request for each name, once all have registered; fails after ``timeout``.

        Fails at once if any registration was refused because its plugin did not answer.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.refused:
                    request, problem = self.refused[0]
                    raise AssertionError(f"{request.resource_name} registered while not serving: {problem}")
                latest = {r.resource_name: r for r in self.requests}
                if resource_names <= set(latest):
                    return latest
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"not registered within {timeout}s: {sorted(resource_names - set(latest))}")
                self._cond.wait(remaining)


def restart_kubelet(old: FakeKubelet) -> FakeKubelet:
    """What a restarting kubelet does: it goes, empties its folder of sockets, comes back."""
    old.stop()
    for name in os.listdir(old.directory):
        os.unlink(os.path.join(old.directory, name))
    return FakeKubelet(old.directory).start()


class PluginClient:
    """The kubelet's side of one plugin socket."""

    def __init__(self, directory: str, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{os.path.join(directory, endpoint)}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> PluginClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream:
    """An open ListAndWatch stream read on a thread, so a test can wait for the next message with a timeout."""

    def __init__(self, client: PluginClient) -> None:
        self.call = client.stub.ListAndWatch(pb.Empty())
        self.messages: list[pb.ListAndWatchResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._cond:
                    self.messages.append(message)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def message(self, number: int, timeout: float = 5.0) -> pb.ListAndWatchResponse:
        """The ``number``-th message (from 0), waiting for it up to ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.messages) > number or self.ended.is_set(), timeout):
                raise AssertionError(f"ListAndWatch message {number} did not come within {timeout}s")
            if len(self.messages) <= number:
                raise AssertionError(f"ListAndWatch ended before message {number}: {self.error}")
            return self.messages[number]

    def cancel(self) -> None:
        self.call.cancel()


def health_by_id(message: pb.ListAndWatchResponse) -> dict[str, str]:
    return {d.ID: d.health for d in message.devices}
