"""We test the real `gpushard serve` where it sits in the path of every pod creation:
- clients that connect and send nothing, stall mid-handshake or stall mid-request do not starve it: a
  normal review is still answered, and the stalled connections are closed after --client-timeout; one
  that trickles its request a byte at a time is cut off too;
- eight times as many such connections as threads, opened again as soon as they are closed, hold no thread:
  every review sent meanwhile is answered within the API server's 5 s;
- new certificate files, swapped in the way a Secret volume updates them (the ..data symlink), are served
  to every new connection without a restart, whichever worker takes it; connections made before keep
  working; a pair that does not load leaves the last good one served, with a warning;
- SIGTERM under a steady load of kept-alive reviews finishes every review in flight: no request dropped;
- a review that takes longer than the worker --timeout (its body arrives slowly) is still answered.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
from pathlib import Path

from tests import stalling
from tests.admission import objects
from tests.polling import eventually
from webhook import certificates


def _review_bytes(uid: str = "u") -> bytes:
    return json.dumps(objects.review(objects.pod(objects.container("t", "0.25")), uid=uid, dry_run=True)).encode()


def _until_closed(sock: socket.socket, within: float = 20.0) -> bytes | None:
    """What the server sends before it closes the connection; None if it is still open after ``within``."""
    sock.settimeout(within)
    received = b""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return received
            received += data
    except (ConnectionResetError, ssl.SSLError, BrokenPipeError):
        return received
    except TimeoutError:
        return None


def _trickle_is_cut(server, context, seconds: float = 15.0, head: bytes = b"POST /mutate HTTP/1.1\r\n") -> bool:
    """Send ``head``, then a byte at a time; whether the server hangs up before ``seconds``."""
    tls = context.wrap_socket(socket.create_connection(("127.0.0.1", server.port)),
                              server_hostname=objects.SERVICE_HOST)
    try:
        tls.sendall(head)
        tls.settimeout(0.25)
        for _ in range(int(seconds / 0.25)):
            try:
                tls.sendall(b"X")
                if tls.recv(1024) == b"":
                    return True
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
                return True
        return False
    finally:
        tls.close()


def test_stalled_clients_do_not_starve_the_server(certs, module_cluster):
    server = objects.Server(certs, module_cluster, "--client-timeout", "1", workers=1, threads=2).start()
    stalled: list[socket.socket] = []
    try:
        context = objects.client_context(certs / "ca.crt")
        # connect, send nothing (gunicorn waits 5 s for data in a thread, then on its poller)
        stalled.append(socket.create_connection(("127.0.0.1", server.port)))
        # start a TLS handshake, never finish it
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"\x16\x03\x01\x02\x00\x01")
        stalled.append(sock)
        for _ in range(2):  # finish the handshake, send half a request
            tls = context.wrap_socket(socket.create_connection(("127.0.0.1", server.port)),
                                      server_hostname=objects.SERVICE_HOST)
            tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: gpushard\r\nContent-Length: 500\r\n\r\n{")
            stalled.append(tls)
        # More stalled connections than threads: the review still gets its answer.
        status, _, body = server.request("POST", "/mutate", _review_bytes(), timeout=30)
        assert status == 200
        assert json.loads(body)["response"]["allowed"] is True
        # Those that stalled mid-handshake were dropped, and those that stalled mid-request answered
        # 400 (the body never came), after --client-timeout.
        assert _until_closed(stalled[1]) == b""
        for sock in stalled[2:]:
            answer = _until_closed(sock)
            assert answer is not None and answer.startswith(b"HTTP/1.1 400") and b"gpushard:" in answer
        # A client that trickles its headers, each byte well within --client-timeout, is cut off too:
        # the whole request has --client-timeout to arrive.
        assert _trickle_is_cut(server, context)
        # So is one that announces a body over the limit (a thread reads it) and trickles that.
        assert _trickle_is_cut(server, context, head=b"POST /mutate HTTP/1.1\r\nHost: gpushard\r\nContent-Length: "
                               + str(40 * 1024 * 1024).encode() + b"\r\n\r\n")
    finally:
        for sock in stalled:
            sock.close()
        server.stop()


def _secret_volume(folder: Path, generation: int, bundle: Path | None = None) -> Path:
    """Lay out ``folder`` as the kubelet lays out a Secret volume, and swap ..data to a new generation."""
    data = folder / f"..gen_{generation}"
    if bundle is None:
        certificates.write_bundle(data)
    else:
        data.mkdir(parents=True)
        for name in ("ca.crt", "tls.crt", "tls.key"):
            (data / name).write_bytes((bundle / name).read_bytes())
    tmp = folder / "..data_tmp"
    os.symlink(data.name, tmp)
    os.replace(tmp, folder / "..data")  # the atomic swap the kubelet does
    for name in ("ca.crt", "tls.crt", "tls.key"):
        link = folder / name
        if not link.is_symlink():
            os.symlink(f"..data/{name}", link)
    return data


def _served_cert(server, ca: Path) -> bytes:
    context = objects.client_context(ca)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=objects.SERVICE_HOST) as tls:
        return tls.getpeercert(binary_form=True)


def _der(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def test_stalled_clients_on_many_connections_hold_no_thread(certs, module_cluster):
    server = objects.Server(certs, module_cluster, workers=1, threads=2).start()
    attack = None
    try:
        attack = stalling.attack(server.port, objects.client_context(certs / "ca.crt"), 16, objects.SERVICE_HOST)
        # The reviews below are sent while the attack goes on: each of its clients is stalling.
        eventually(lambda: len(attack.stalled) == 16, "every stalling client's first stall", gone=server.exited)
        answered = []
        for i in range(20):
            status, _, body = server.request("POST", "/mutate", _review_bytes(f"u{i}"), timeout=5)
            answered.append(status == 200 and json.loads(body)["response"]["uid"] == f"u{i}")
        assert all(answered), answered
    finally:
        if attack is not None:
            attack()
        server.stop()


def test_rotated_certificates_are_served_without_a_restart(tmp_path, module_cluster):
    volume = tmp_path / "secret"
    volume.mkdir()
    first = _secret_volume(volume, 1)
    server = objects.Server(volume, module_cluster, workers=2, threads=2).start()
    try:
        assert _served_cert(server, first / "ca.crt") == _der(first / "tls.crt")
        kept = server.connection(ca=first / "ca.crt")
        assert server.request("POST", "/mutate", _review_bytes(), conn=kept)[0] == 200

        second = _secret_volume(volume, 2)
        # Whichever worker takes a connection checks the files first: every new one gets the new pair.
        for _ in range(8):
            assert _served_cert(server, second / "ca.crt") == _der(second / "tls.crt")
        # A connection made before the rotation keeps working.
        assert server.request("POST", "/mutate", _review_bytes(), conn=kept)[0] == 200
        kept.close()
    finally:
        server.stop()


def test_a_pair_that_does_not_load_leaves_the_last_good_one_served(tmp_path, module_cluster):
    volume = tmp_path / "secret"
    volume.mkdir()
    _secret_volume(volume, 1)
    # One worker, so "the last good pair" is one that this test saw it serve.
    server = objects.Server(volume, module_cluster, workers=1, threads=2).start()
    try:
        second = _secret_volume(volume, 2)
        assert _served_cert(server, second / "ca.crt") == _der(second / "tls.crt")
        # Half-written files: a certificate whose key is not there yet (the old key).
        broken = tmp_path / "broken"
        certificates.write_bundle(broken)
        (broken / "tls.key").write_bytes((second / "tls.key").read_bytes())
        _secret_volume(volume, 3, bundle=broken)
        for _ in range(3):
            assert _served_cert(server, second / "ca.crt") == _der(second / "tls.crt")
        conn = server.connection(ca=second / "ca.crt")
        assert server.request("POST", "/mutate", _review_bytes(), conn=conn)[0] == 200
        conn.close()
        assert "keeping the current certificate" in server.output()
    finally:
        server.stop()


class _Load:
    """Clients sending reviews back to back on kept-alive connections, until the server stops."""

    def __init__(self, server, clients: int):
        self.server = server
        self.answered = 0
        self.after_term = 0
        self.dropped: list[str] = []
        self.term_at: float | None = None
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(clients)]

    def run(self, index: int) -> None:
        deadline = time.monotonic() + 40  # bounded, whatever happens
        conn = None
        n = 0
        while time.monotonic() < deadline:
            if conn is None:
                try:
                    conn = self.server.connection(timeout=15)
                except (ConnectionRefusedError, ConnectionResetError, ssl.SSLError):
                    if self.term_at is not None:
                        return  # the listener is gone: nothing was sent, nothing dropped
                    raise
            uid = f"c{index}-{n}"
            n += 1
            try:
                conn.request("POST", "/mutate", body=_review_bytes(uid), headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                body = resp.read()
            except Exception as exc:  # a request sent and never answered
                with self.lock:
                    self.dropped.append(f"{uid}: {exc!r}")
                conn.close()
                conn = None
                continue
            if resp.status != 200 or json.loads(body)["response"]["uid"] != uid:
                with self.lock:
                    self.dropped.append(f"{uid}: HTTP {resp.status}")
            else:
                with self.lock:
                    self.answered += 1
                    self.after_term += self.term_at is not None
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
                conn = None
                if self.term_at is not None:
                    return
        if conn is not None:
            conn.close()


def test_sigterm_under_load_drops_no_review(certs, module_cluster):
    server = objects.Server(certs, module_cluster, "--graceful-timeout", "10", workers=2, threads=4).start()
    try:
        load = _Load(server, clients=6)
        for thread in load.threads:
            thread.start()
        eventually(lambda: load.answered >= 100, "100 reviews answered", timeout=40, interval=0.05,
                   gone=lambda: None if all(t.is_alive() for t in load.threads) else (
                       f"a client ended (dropped: {load.dropped[:5]})"))
        load.term_at = time.monotonic()
        server.signal(15)
        for thread in load.threads:
            thread.join(60)
        code = server.proc.wait(30)
        assert not load.dropped, load.dropped[:5]
        assert load.answered >= 100
        assert code == 0, server.output()
    finally:
        server.stop()


def test_a_review_that_outlasts_the_worker_timeout_is_answered(certs, module_cluster):
    # gthread's heartbeat is its main loop, not the request's thread: a slow review (here, a body
    # that arrives over about twice --timeout) is answered, and its worker is not killed.
    server = objects.Server(certs, module_cluster, "--timeout", "2", "--client-timeout", "5", workers=1,
                            threads=2).start()
    try:
        body = _review_bytes("slow")
        conn = server.connection(timeout=30)
        conn.putrequest("POST", "/mutate")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        pieces = [body[i:i + len(body) // 8 + 1] for i in range(0, len(body), len(body) // 8 + 1)]
        for piece in pieces:
            conn.send(piece)
            time.sleep(0.5)  # the stimulus, not a wait: the body arrives slowly, over about twice --timeout
        resp = conn.getresponse()
        assert resp.status == 200
        assert json.loads(resp.read())["response"]["uid"] == "slow"
        conn.close()
        assert "WORKER TIMEOUT" not in server.output()
    finally:
        server.stop()
