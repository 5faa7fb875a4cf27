"""We test the shipped-install tier's cluster DNS (tests/runtime/clusterdns.py) against the resolver every
Python has: the queries are built and read by hand per RFC 1035 and, over UDP, by a real responder thread:
- a Service's name (``<service>.<namespace>.svc.cluster.local``) gets one A record with its ClusterIP;
- an AAAA query for it gets NOERROR and no record (no data), so a resolver falls back to the A answer;
- an unknown Service, a search-list miss and a name of another shape in the domain get NXDOMAIN;
- a name outside the domain is refused, never forwarded;
- a lookup that fails gives SERVFAIL; a malformed query FORMERR; the responder keeps serving after both.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest

from tests.runtime import clusterdns

SERVICES = {("gpushard", "gpushard-system"): "10.0.0.42"}


def lookup(service: str, namespace: str) -> str | None:
    if namespace == "broken":
        raise ConnectionError("the API server is down")
    return SERVICES.get((service, namespace))


def query(name: str, qtype: int = clusterdns.A, ident: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + labels + struct.pack("!HH", qtype, 1)


def read(response: bytes) -> tuple[int, int, list[str]]:
    ident, flags, questions, answers = struct.unpack("!HHHH", response[:8])
    assert flags & 0x8000, "not a response"
    at = 12
    for _ in range(questions):
        while response[at]:
            at += response[at] + 1
        at += 5
    addresses = []
    for _ in range(answers):
        pointer, rtype, rclass, ttl, length = struct.unpack("!HHHIH", response[at:at + 12])
        assert (pointer, rtype, rclass, length) == (0xC00C, clusterdns.A, 1, 4)
        addresses.append(str(ipaddress.IPv4Address(response[at + 12:at + 16])))
        at += 16
    assert at == len(response)
    return ident, flags & 0xF, addresses


def test_a_service_name_resolves_to_its_cluster_ip():
    ident, rcode, addresses = read(clusterdns.answer(query("gpushard.gpushard-system.svc.cluster.local"), lookup))
    assert (ident, rcode, addresses) == (0x1234, clusterdns.NOERROR, ["10.0.0.42"])


def test_names_are_case_insensitive():
    assert read(clusterdns.answer(query("GPUshard.gpushard-system.SVC.cluster.local"), lookup))[2] == ["10.0.0.42"]


def test_aaaa_of_a_service_has_no_data():
    assert read(clusterdns.answer(query("gpushard.gpushard-system.svc.cluster.local", 28), lookup))[1:] == (
        clusterdns.NOERROR, [])


@pytest.mark.parametrize("name", ["other.gpushard-system.svc.cluster.local",
                                  # the first search-list try of a pod in gpushard-system asking gpushard.<ns>.svc
                                  "gpushard.gpushard-system.svc.gpushard-system.svc.cluster.local",
                                  "gpushard-system.svc.cluster.local", "node.cluster.local"])
def test_other_names_in_the_domain_do_not_exist(name):
    assert read(clusterdns.answer(query(name), lookup))[1:] == (clusterdns.NXDOMAIN, [])


@pytest.mark.parametrize("name", ["ghcr.io", "cluster.local.example.com"])
def test_names_outside_the_domain_are_refused(name):
    assert read(clusterdns.answer(query(name), lookup))[1:] == (clusterdns.REFUSED, [])


def test_a_failed_lookup_is_servfail():
    assert read(clusterdns.answer(query("gpushard.broken.svc.cluster.local"), lookup))[1:] == (
        clusterdns.SERVFAIL, [])


@pytest.mark.parametrize("message", [b"", b"\x12", b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x05abc",
                                     b"\x12\x34\x01\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x01"])
def test_a_malformed_query_is_formerr(message):
    response = clusterdns.answer(message, lookup)
    assert struct.unpack("!H", response[2:4])[0] & 0xF == clusterdns.FORMERR


def test_the_responder_answers_over_udp_and_keeps_serving():
    responder = clusterdns.Responder("127.0.0.1", lookup, port=0).start()
    port = responder.port
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(5)
            for message in (b"\x00", query("gpushard.broken.svc.cluster.local"),
                            query("gpushard.gpushard-system.svc.cluster.local", ident=7)):
                client.sendto(message, ("127.0.0.1", port))
                response, _ = client.recvfrom(512)
            assert read(response) == (7, clusterdns.NOERROR, ["10.0.0.42"])
    finally:
        responder.stop()
    assert responder.answered == 3
