"""A client that stalls on the webhook's port, for the tests and the bench that show it holds no review."""

from __future__ import annotations

import socket
import ssl
import threading


def stall(port: int, context: ssl.SSLContext, stop: threading.Event, mid_request: bool,
          server_hostname: str | None = None) -> None:
    """Until ``stop``: open a connection, send the first bytes of a TLS handshake (or finish the handshake and send a
    request's head and one byte of its body), wait for the webhook to close it, and open another."""
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if mid_request:
                sock = context.wrap_socket(sock, server_hostname=server_hostname)
                sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: gpushard\r\nContent-Length: 500\r\n\r\n{")
            else:
                sock.sendall(b"\x16\x03\x01\x02\x00\x01")
            try:
                while sock.recv(4096):
                    pass
            except OSError:
                pass
            sock.close()
        except OSError:
            stop.wait(0.05)


def attack(port: int, context: ssl.SSLContext, clients: int, server_hostname: str | None = None,
           mid_request: bool | None = None):
    """``clients`` stalling threads, each mid-request or mid-handshake as ``mid_request`` says (None: every other
    one mid-request); the function it returns ends them."""
    stop = threading.Event()
    threads = [threading.Thread(target=stall, args=(port, context, stop, i % 2 == 1 if mid_request is None
                                                    else mid_request, server_hostname), daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()

    def ended() -> None:
        stop.set()
        for thread in threads:
            thread.join(timeout=15)
    return ended
