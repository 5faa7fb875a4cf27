"""What cluster DNS and kube-proxy do for a Service, for the tier's pods: its name resolves and its address routes.

The shipped-install tier runs no CoreDNS and no kube-proxy. A pod that reaches a Service by its DNS name (the
chart's ``helm test`` pod posts to ``https://gpushard.<namespace>.svc``) needs both, so the tier provides the two
pieces it needs, no more:

- ``Responder``: a DNS server on the node's address, given to the kubelet as ``clusterDNS``. It answers ``A``
  queries for ``<service>.<namespace>.svc.<domain>`` with the Service's ClusterIP, read from the API server on
  each query; any other name in the domain is NXDOMAIN, a Service name's other record types have no data, and
  names outside the domain are refused (nothing here is forwarded off the machine).
- ``node.ServiceRoute`` with ``masquerade``: the ClusterIP's port sent to one Ready endpoint, as kube-proxy's
  DNAT does; masqueraded, because the endpoint is on the client's own bridge and would answer it directly.

``answer`` is the whole protocol part, a pure function of the query (RFC 1035 sections 4.1.1 to 4.1.3), tested in
``tests/test_clusterdns.py``.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading
from collections.abc import Callable

A = 1
CLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, REFUSED = 0, 1, 2, 3, 5
TTL = 5  # seconds: a Service's address can change between tests


def parse_question(query: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, name, qtype, end of the question) of a one-question query; ValueError when it is not one."""
    if len(query) < 12:
        raise ValueError("shorter than a DNS header")
    ident, flags, questions = struct.unpack("!HHH", query[:6])
    if flags & 0x8000 or questions != 1:
        raise ValueError("not a query of one question")
    labels, at = [], 12
    while True:
        if at >= len(query):
            raise ValueError("name runs past the message")
        length = query[at]
        at += 1
        if length == 0:
            break
        if length & 0xC0:
            raise ValueError("a compressed name in a question")
        labels.append(query[at:at + length].decode("ascii", "replace"))
        at += length
    if at + 4 > len(query):
        raise ValueError("question without type and class")
    qtype, qclass = struct.unpack("!HH", query[at:at + 4])
    if qclass != CLASS_IN:
        raise ValueError(f"class {qclass}")
    return ident, flags, ".".join(labels).lower(), qtype, at + 4


def service_of(name: str, domain: str) -> tuple[str, str] | None:
    """(service, namespace) a name ``<service>.<namespace>.svc.<domain>`` asks for, or None."""
    suffix = f".svc.{domain}"
    if not name.endswith(suffix):
        return None
    parts = name[:-len(suffix)].split(".")
    return (parts[0], parts[1]) if len(parts) == 2 and all(parts) else None


def answer(query: bytes, lookup: Callable[[str, str], str | None], domain: str = "cluster.local") -> bytes:
    """The response to ``query``: ``lookup(service, namespace)`` gives a Service's ClusterIP, or None."""
    try:
        ident, flags, name, qtype, end = parse_question(query)
    except ValueError:
        ident = struct.unpack("!H", query[:2])[0] if len(query) >= 2 else 0
        return struct.pack("!HHHHHH", ident, 0x8000 | FORMERR, 0, 0, 0, 0)
    question = query[12:end]
    recursion = flags & 0x0100
    wanted = service_of(name, domain)
    if name != domain and not name.endswith("." + domain):
        rcode, address = REFUSED, None
    elif wanted is None:
        rcode, address = NXDOMAIN, None
    else:
        try:
            address = lookup(*wanted)
        except Exception:  # the API server unreachable: the resolver tries again, as it would with CoreDNS
            address = None
            rcode = SERVFAIL
        else:
            rcode = NXDOMAIN if address is None else NOERROR
    records = b""
    if address is not None and qtype == A:
        # The name as a pointer to the question's (offset 12), type A, class IN, TTL, four bytes of address.
        records = struct.pack("!HHHIH", 0xC00C, A, CLASS_IN, TTL, 4) + ipaddress.IPv4Address(address).packed
    header = struct.pack("!HHHHHH", ident, 0x8000 | 0x0400 | recursion | rcode, 1, 1 if records else 0, 0, 0)
    return header + question + records


class Responder:
    """``answer`` served over UDP on ``address``:53 from a thread, until ``stop()``."""

    def __init__(self, address: str, lookup: Callable[[str, str], str | None], domain: str = "cluster.local",
                 port: int = 53):
        self.address, self.port, self.lookup, self.domain = address, port, lookup, domain
        self.answered = 0
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Responder:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((self.address, self.port))
        self.port = self._socket.getsockname()[1]  # the one given, or the one the system chose for 0
        self._socket.settimeout(0.5)
        self._thread = threading.Thread(target=self._serve, name="gpushard-e2e-dns", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        sock = self._socket
        while self._socket is not None:
            try:
                query, peer = sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                sock.sendto(answer(query, self.lookup, self.domain), peer)
                self.answered += 1
            except OSError:
                continue

    def stop(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()
        if self._thread is not None:
            self._thread.join(5)
