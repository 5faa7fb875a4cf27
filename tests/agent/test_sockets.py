"""We test the agent's unix sockets (webhook/agent/node/sockets.py), which both backends' gRPC servers use,
on real files:
- a server binds a fresh socket over a stale file and gets its identity; one that cannot be bound (a path over
  the 107 bytes of sun_path, a folder it may not write) is an OSError that says why, never a server serving
  nothing;
- a file made again at the same path, even with the same inode number, is not the server's own: stop removes
  only the file that is still its own.
"""

from __future__ import annotations

import os
import socket
from concurrent import futures

import grpc
import pytest

from tests.agent import fakekubelet
from webhook.agent.node import sockets


def server() -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=1))


def test_a_fresh_socket_over_a_stale_file_and_its_identity():
    folder = fakekubelet.short_tempdir()
    try:
        path = os.path.join(folder, "x.sock")
        with open(path, "w") as fh:
            fh.write("stale")
        s = server()
        ours = sockets.bind(s, path)
        s.start()
        assert ours == sockets.identity(path) and os.path.exists(path)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)  # a socket, no longer the stale file
        s.stop(0).wait()
        sockets.remove_if_ours(path, ours)
        assert not os.path.exists(path)
    finally:
        fakekubelet.remove_tree(folder)


def test_a_socket_made_again_at_the_same_path_is_not_ours():
    folder = fakekubelet.short_tempdir()
    try:
        path = os.path.join(folder, "x.sock")
        first = server()
        ours = sockets.bind(first, path)
        first.start()
        os.unlink(path)
        second = server()
        theirs = sockets.bind(second, path)  # as a restarted kubelet's folder holds another file now
        second.start()
        assert theirs != ours
        sockets.remove_if_ours(path, ours)
        assert os.path.exists(path), "another's file was removed"
        first.stop(0).wait()
        second.stop(0).wait()
    finally:
        fakekubelet.remove_tree(folder)


def test_a_socket_that_cannot_be_bound_says_why():
    folder = fakekubelet.short_tempdir()
    try:
        long_path = os.path.join(folder, "x" * 120 + ".sock")
        with pytest.raises(OSError, match=r"cannot listen on .*: the path is \d+ bytes, and a unix socket path must "
                                          r"be at most 107"):
            sockets.bind(server(), long_path)
        if os.geteuid() != 0:  # root writes anywhere
            locked = os.path.join(folder, "locked")
            os.makedirs(locked, mode=0o500)
            with pytest.raises(OSError, match="cannot listen on"):
                sockets.bind(server(), os.path.join(locked, "x.sock"))
    finally:
        fakekubelet.remove_tree(folder)
