"""A client that stalls on the webhook's port, for the tests and the bench that show it holds no review."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable


def stall(port: int, context: ssl.SSLContext, stop: threading.Event, mid_request: bool,
          server_hostname: str | None = None, stalling: Callable[[], None] | None = None) -> None:
    """Until ``stop``: open a connection, send the first bytes of a TLS handshake (or finish the handshake and send a
    request's head and one byte of its body), wait for the webhook to close it, and open another. ``stalling`` is
    called each time those bytes are sent."""
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if mid_request:
                sock = context.wrap_socket(sock, server_hostname=server_hostname)
                sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: gpushard\r\nContent-Length: 500\r\n\r\n{")
            else:
                sock.sendall(b"\x16\x03\x01\x02\x00\x01")
            if stalling is not None:
                stalling()
            try:
                while sock.recv(4096):
                    pass
            except OSError:
                pass
            sock.close()
        except OSError:
            stop.wait(0.05)


class Attack:
    """The stalling clients that ``attack`` started. ``stalled`` holds the numbers of those that have sent their
    stalling bytes at least once; calling it ends them all."""

    def __init__(self, stop: threading.Event, threads: list[threading.Thread], stalled: set[int]) -> None:
        self.stop, self.threads, self.stalled = stop, threads, stalled

    def __call__(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=15)


def attack(port: int, context: ssl.SSLContext, clients: int, server_hostname: str | None = None,
           mid_request: bool | None = None) -> Attack:
    """``clients`` stalling threads, each mid-request or mid-handshake as ``mid_request`` says (None: every other
    one mid-request); calling what it returns ends them."""
    stop = threading.Event()
    stalled: set[int] = set()
    threads = [threading.Thread(target=stall, args=(port, context, stop, i % 2 == 1 if mid_request is None
                                                    else mid_request, server_hostname,
                                                    lambda i=i: stalled.add(i)), daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()
    return Attack(stop, threads, stalled)
