"""We test the real `gpushard serve` (gunicorn, two workers, TLS from `gpushard certs`, a static view):
- a client that trusts only the CA and checks the Service's name reviews a pod and a Deployment through
  /mutate and a pod through /audit, several reviews on one kept-alive connection, the uid echoed;
- a client trusting another CA, or checking another name, is refused at the handshake;
- /healthz, /readyz, and /metrics summed over both workers, reflecting every request answered before the scrape,
  with the view's state and the certificate's expiry;
- with one worker (the default) a scrape counts every review answered before it, and the counts
  survive a restart of the workers (SIGHUP), as the latency histogram does;
- a body that is no AdmissionReview is a 400, over the wire; a review over the size limit is read to its end
  and denied by its uid, twice on one connection;
- bad certificate, key, bind or cluster arguments stop `serve` with a message naming the problem.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys

import pytest

from tests.admission import objects
from tests.polling import eventually
from webhook.admission import app as app_mod


def _review(server, path, obj, conn=None, **kw):
    review = objects.review(obj, **kw)
    status, headers, body = server.request("POST", path, json.dumps(review).encode(), conn=conn)
    assert status == 200, body
    assert headers["Content-Type"] == "application/json"
    return objects.response_of(json.loads(body), review["request"]["uid"])


def _admissions(server) -> dict[tuple[str, str, str], float]:
    status, _, body = server.request("GET", "/metrics")
    assert status == 200
    found = {}
    for kind, mode, outcome, value in re.findall(
            r'^gpushard_admissions_total\{kind="(\w+)",mode="(\w+)",outcome="(\w+)"\} (\S+)$', body.decode(), re.M):
        found[(kind, mode, outcome)] = float(value)
    return found


def test_reviews_over_verified_tls_with_keep_alive(server):
    conn = server.connection()
    try:
        pod = objects.pod(objects.container("train", "0.5"), objects.container("side"))
        new = objects.patched(pod, _review(server, "/mutate", pod, conn=conn))
        objects.assert_api_server_accepts(new)
        assert objects.env_of(new["spec"]["containers"][1]) == {"NVIDIA_VISIBLE_DEVICES": "void"}
        dep = objects.deployment(objects.container("serve", "0.2"))
        new = objects.patched(dep, _review(server, "/mutate", dep, conn=conn))
        objects.assert_api_server_accepts(new)
        audit = _review(server, "/audit", objects.pod(objects.container("t", "0.333")), conn=conn)
        assert "patch" not in audit and audit["warnings"] and audit["auditAnnotations"]
        denied = _review(server, "/mutate", objects.pod(objects.container("t", "4")), conn=conn)
        assert denied["allowed"] is False and denied["status"]["code"] == 403
        peer = conn.sock.getpeercert()
        assert ("DNS", objects.SERVICE_HOST) in peer["subjectAltName"]
    finally:
        conn.close()


def test_a_client_that_trusts_another_ca_is_refused(server, tmp_path):
    other = objects.make_certs(tmp_path / "other")
    with pytest.raises(ssl.SSLCertVerificationError):
        server.connection(ca=other / "ca.crt")
    with pytest.raises(ssl.SSLCertVerificationError):
        server.connection(hostname="evil.gpushard-system.svc")


def test_health_and_readiness(server):
    assert server.request("GET", "/healthz")[0] == 200
    status, _, body = server.request("GET", "/readyz")
    assert status == 200 and b"synced" in body


def test_metrics_add_up_over_every_worker(server):
    # A worker counts a review before it answers: any scrape holds every review answered before it.
    before = _admissions(server)
    # Separate connections, so both workers take a share of the reviews.
    for _ in range(12):
        _review(server, "/mutate", objects.pod(objects.container("t", "0.1")), dry_run=True)
    for _ in range(3):
        _review(server, "/audit", objects.pod(objects.container("t", "0.1")))
    server.request("POST", "/mutate", b"[]")
    want = {("Pod", "enforce", "patched"): 12, ("Pod", "audit", "allowed"): 3, ("unknown", "enforce", "invalid"): 1}

    def deltas():
        after = _admissions(server)
        return {key: after.get(key, 0) - before.get(key, 0) for key in want}

    assert deltas() == want
    status, _, body = server.request("GET", "/metrics")
    assert b"gpushard_admission_seconds_bucket" in body
    # The worker that answers adds its view's state and the serving certificate's expiry.
    assert b"\ngpushard_view_synced 1.0\n" in body
    expiry = float(body.split(b"\ngpushard_certificate_expiry_seconds ")[1].split(b"\n")[0])
    assert 300 * 86400 < expiry <= 366 * 86400


def test_one_worker_counts_at_once_and_keeps_its_counts_over_a_restart(certs, module_cluster):
    srv = objects.Server(certs, module_cluster, workers=1).start()
    try:
        for _ in range(5):
            _review(srv, "/mutate", objects.pod(objects.container("t", "0.1")), dry_run=True)
        assert _admissions(srv) == {("Pod", "enforce", "patched"): 5.0}
        _, _, body = srv.request("GET", "/metrics")
        assert b'gpushard_admission_seconds_count{mode="enforce"} 5.0' in body
        # gunicorn starts a new worker and stops the old one, which has counted since the last scrape.
        _review(srv, "/mutate", objects.pod(objects.container("t", "0.1")), dry_run=True)
        srv.signal(signal.SIGHUP)
        old = eventually(lambda: re.findall(r"Worker exiting \(pid: (\d+)\)", srv.output()), "the old worker exiting",
                         timeout=30, interval=0.1, gone=srv.exited)
        eventually(lambda: not os.path.exists(f"/proc/{old[0]}"), "the master reaping the old worker", timeout=30,
                   interval=0.1, gone=srv.exited)
        assert _admissions(srv) == {("Pod", "enforce", "patched"): 6.0}
        _, _, body = srv.request("GET", "/metrics")
        assert b'gpushard_admission_seconds_count{mode="enforce"} 6.0' in body
        _review(srv, "/mutate", objects.pod(objects.container("t", "0.1")), dry_run=True)
        assert _admissions(srv) == {("Pod", "enforce", "patched"): 7.0}
    finally:
        srv.stop()


def test_bad_bodies_over_the_wire(server):
    status, _, body = server.request("POST", "/mutate", b"not json")
    assert status == 400 and body.startswith(b"gpushard:")
    # A review over the limit is read to its end and denied by its uid, on a connection that stays usable.
    review = objects.review(objects.pod(objects.container("t")), uid="big")
    review["request"]["object"]["metadata"]["annotations"] = {"big": "<" * (app_mod.MAX_BODY + 1)}
    conn = server.connection()
    try:
        for _ in range(2):
            conn.request("POST", "/mutate", json.dumps(review).encode(), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = json.loads(resp.read())["response"]
            assert resp.status == 200 and answer["uid"] == "big" and not answer["allowed"]
            assert "over the 32 MiB gpushard reads" in answer["status"]["message"]
    finally:
        conn.close()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "webhook.cli", "serve", *args], capture_output=True, text=True,
                          timeout=60)


def test_bad_arguments_stop_serve_with_a_message(certs, module_cluster, tmp_path):
    crt, key = str(certs / "tls.crt"), str(certs / "tls.key")
    missing = str(tmp_path / "missing.crt")
    result = _serve("--cert", missing, "--key", key, "--cluster", str(module_cluster))
    assert result.returncode != 0 and f"gpushard: cannot read the serving certificate {missing}" in result.stderr
    result = _serve("--cert", crt, "--key", missing, "--cluster", str(module_cluster))
    assert result.returncode != 0 and f"gpushard: cannot read the serving key {missing}" in result.stderr
    result = _serve("--cert", key, "--key", crt, "--cluster", str(module_cluster))
    assert result.returncode != 0 and "gpushard:" in result.stderr and key in result.stderr
    result = _serve("--cert", crt, "--key", key, "--bind", "nowhere", "--cluster", str(module_cluster))
    assert result.returncode != 0 and "gpushard: --bind" in result.stderr
    bad = tmp_path / "cluster.yaml"
    bad.write_text("nodes: [{name: n, cards: [{index: -1}]}]\n")
    result = _serve("--cert", crt, "--key", key, "--bind", "127.0.0.1:1", "--cluster", str(bad))
    assert result.returncode != 0 and "gpushard: bad cluster file" in result.stderr and "index" in result.stderr
