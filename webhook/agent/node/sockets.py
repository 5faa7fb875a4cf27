"""The agent's gRPC servers on unix sockets: bound loudly, and told apart from a file that replaced them.

Both backends serve the kubelet on a socket in a folder the kubelet owns (the device plugins in
``device-plugins/``, the DRA plugin under ``plugins/`` and ``plugins_registry/``). A restarting kubelet
removes what it finds there, and a restarted agent finds its own old files: each server binds a fresh
socket, says why when it cannot, and removes on stop only a file that is still its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent import futures

import grpc

# sockaddr_un's sun_path holds 108 bytes on Linux, the last one the terminating NUL.
MAX_SOCKET_PATH = 107


def identity(path: str) -> tuple[int, int] | None:
    """What tells this socket file from one made later at the same path; None when there is none.

    The inode alone is not enough: a file recreated at once often gets the same number back.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)


def bind(server: grpc.Server, path: str) -> tuple[int, int]:
    """Remove a stale file at ``path`` and bind ``server`` there; the new socket's identity. OSError, saying
    why, when it cannot be bound (grpc only returns 0, or raises RuntimeError)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.unlink(path)  # a socket left by an earlier agent
    except FileNotFoundError:
        pass
    try:
        bound = server.add_insecure_port(f"unix://{path}")
    except RuntimeError as exc:
        bound, reason = 0, str(exc)
    else:
        reason = "grpc could not bind it"
    if not bound:
        size = len(os.fsencode(path))
        if size > MAX_SOCKET_PATH:
            # grpc's own message names no cause; a path too long is one we can tell for sure from here.
            reason = f"the path is {size} bytes, and a unix socket path must be at most {MAX_SOCKET_PATH}"
        raise OSError(f"cannot listen on {path}: {reason}")
    found = identity(path)
    if found is None:
        raise OSError(f"cannot listen on {path}: the socket file is not there after binding")
    return found


def remove_if_ours(path: str, ours: tuple[int, int] | None) -> None:
    """Remove the socket file at ``path`` if it is still the one whose identity is ``ours``."""
    if ours is not None and identity(path) == ours:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Server:
    """One gRPC server on one unix socket, started again on a fresh socket when its file goes.

    ``add`` puts the services on each new grpc.Server (a fresh servicer per start, where one is needed);
    ``workers`` bounds the calls and streams served at once (each stream holds a worker for its life).
    """

    def __init__(self, path: str, add: Callable[[grpc.Server], None], workers: int, name: str = "") -> None:
        self.path = path
        self.add = add
        self.workers = workers
        self.name = name or os.path.basename(path)
        self._server: grpc.Server | None = None
        self.identity: tuple[int, int] | None = None

    def start(self) -> None:
        """Serve on a fresh socket, replacing any stale file left by an earlier run (OSError when it cannot)."""
        self.stop()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name))
        self.add(server)
        self.identity = bind(server, self.path)
        server.start()
        self._server = server

    @property
    def serving(self) -> bool:
        return self._server is not None

    def is_ours(self) -> bool:
        """False once the socket file is gone or replaced, as a restarting kubelet does."""
        return self.identity is not None and identity(self.path) == self.identity

    def answers(self, timeout: float = 2.0) -> bool:
        """Whether a client connecting to the socket now gets an HTTP/2 connection within ``timeout``."""
        with grpc.insecure_channel(f"unix://{self.path}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                return False
        return True

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving and remove the socket (only if it is still ours)."""
        if self._server is None:
            return
        self._server.stop(grace).wait(grace + 1.0)
        self._server = None
        remove_if_ours(self.path, self.identity)
        self.identity = None
