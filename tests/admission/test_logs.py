"""We test the webhook's log of refusals:
- one structured (JSON) line per denial, with namespace, name, kind, rule, uid, code and message;
- an unreadable object is logged as "invalid" with rule "unreadable";
- an internal error is one "error" line naming the review, without a traceback unless debugging;
- allowed and patched pods, and anything in audit mode, log nothing;
- the real `gpushard serve` writes the same line to its stderr;
- a connection that reaches --client-timeout without a request (a bare handshake, part of a request line, a
  handshake never finished) is closed quietly, without a traceback or an ERROR line, and the server still
  answers; one whose request started and stalled is one WARNING line without a traceback; any other socket
  error keeps its ERROR line and traceback.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from tests.admission import objects
from tests.polling import eventually
from webhook.admission import logs
from webhook.core import decisions

LOGGER = "gpushard.admission.decisions"


def post(client, path: str, review: dict) -> dict:
    resp = client.post(path, data=json.dumps(review), content_type="application/json")
    assert resp.status_code == 200
    return objects.response_of(resp.get_json(), review["request"]["uid"])


def lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def caplog(caplog):
    caplog.set_level(logging.INFO, logger="gpushard")
    return caplog


def test_a_denial_is_one_structured_line(client, caplog):
    review = objects.review(objects.pod(objects.container("train", "1.5"), name="big"), uid="u-1")
    assert post(client, "/mutate", review)["allowed"] is False
    (line,) = lines(caplog)
    assert line == {"event": "denied", "mode": "enforce", "uid": "u-1", "operation": "CREATE", "kind": "Pod",
                    "namespace": "ml", "name": "big", "rule": "fraction-above-one", "code": 403,
                    "message": line["message"]}
    assert line["message"].startswith("gpushard:") and "1.5" in line["message"]
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()


def test_a_pod_from_a_controller_is_named_by_its_generate_name(client, caplog):
    obj = objects.pod(objects.container("a", "0.7"), objects.container("b", "0.7"))
    obj["metadata"] = {"generateName": "train-7d9f-", "namespace": "ml"}
    post(client, "/mutate", objects.review(obj, uid="u-2"))
    (line,) = lines(caplog)
    assert (line["name"], line["rule"], line["uid"]) == ("train-7d9f-", "pod-over-card", "u-2")


def test_an_unreadable_object_is_logged_as_invalid(client, caplog):
    obj = objects.pod(objects.container("t", "0.5"))
    obj["spec"]["containers"] = "not a list"
    response = post(client, "/mutate", objects.review(obj, uid="u-3"))
    assert response["status"]["code"] == 400
    (line,) = lines(caplog)
    assert (line["event"], line["code"], line["uid"]) == ("invalid", 400, "u-3")
    assert line["rule"] == "unreadable"


def test_allowed_pods_and_audit_mode_log_nothing(client, caplog):
    post(client, "/mutate", objects.review(objects.pod(objects.container("t", "0.25"))))
    post(client, "/mutate", objects.review(objects.pod(objects.container("web"))))
    post(client, "/mutate", objects.review(objects.deployment(objects.container("t", "0.5"))))
    post(client, "/audit", objects.review(objects.pod(objects.container("train", "1.5"))))
    assert lines(caplog) == []


def test_an_internal_error_is_one_line_without_a_traceback(client, caplog, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    # The core's entry point stands in for any bug inside it; no library internals are touched.
    monkeypatch.setattr(decisions, "decide", broken)
    post(client, "/mutate", objects.review(objects.pod(objects.container("t", "0.5"), name="p9"), uid="u-4"))
    (line,) = lines(caplog)
    assert line["event"] == "error" and line["uid"] == "u-4" and line["name"] == "p9"
    assert line["message"] == "KeyError: 'a bug'"
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.ERROR and record.exc_info is None


def test_the_fields_of_an_odd_request_never_raise():
    assert logs.fields("denied", {"uid": 5, "kind": "Pod", "object": ["x"]}, "enforce") == {
        "event": "denied", "mode": "enforce"}


def test_the_real_server_logs_a_denial_to_stderr(server):
    review = objects.review(objects.pod(objects.container("train", "2"), name="two-cards"), uid="u-real")
    status, _, _ = server.request("POST", "/mutate", json.dumps(review).encode())
    assert status == 200
    eventually(lambda: '"uid":"u-real"' in server.output(), "the denial in the server's log", timeout=10,
               interval=0.1)
    found = [line for line in server.output().splitlines() if '"uid":"u-real"' in line]
    assert len(found) == 1, server.output()
    logged = json.loads(found[0][found[0].index("{"):])
    assert (logged["event"], logged["name"], logged["rule"]) == ("denied", "two-cards", "multi-card")


def _log_lines(srv, level: str) -> list[str]:
    return [line for line in srv.log.read_text(errors="replace").splitlines() if f"[{level}]" in line]


def test_connections_that_send_no_request_are_closed_quietly(certs, module_cluster):
    srv = objects.Server(certs, module_cluster, "--client-timeout", "1", workers=1, threads=4).start()
    held: list[socket.socket] = []
    try:
        context = objects.client_context(certs / "ca.crt")

        def handshaken() -> socket.socket:
            tls = context.wrap_socket(socket.create_connection(("127.0.0.1", srv.port)),
                                      server_hostname=objects.SERVICE_HOST)
            held.append(tls)
            return tls

        handshaken()  # as the API server's connection pool and load balancers' TLS checks do
        handshaken().sendall(b"POST /mut")  # part of a request line
        raw = socket.create_connection(("127.0.0.1", srv.port))
        raw.sendall(b"\x16\x03\x01\x02\x00\x01")  # a handshake begun and never finished
        held.append(raw)
        handshaken().sendall(b"POST /mutate HTTP/1.1\r\nHost: gpushard\r\n")  # headers that stall
        time.sleep(3)  # the stimulus, not a wait: well past the read deadline (1 s), so the server gives up on them
        review = objects.review(objects.pod(objects.container("t", "0.25")), uid="u-after", dry_run=True)
        status, _, body = srv.request("POST", "/mutate", json.dumps(review).encode())
        assert status == 200 and json.loads(body)["response"]["allowed"] is True
        eventually(lambda: _log_lines(srv, "WARNING"), "the server's warning", timeout=10, interval=0.1)
        text = srv.log.read_text(errors="replace")
        assert "Traceback" not in text and not _log_lines(srv, "ERROR"), text
        (warning,) = _log_lines(srv, "WARNING")
        assert "gpushard: gave up on a request from 127.0.0.1:" in warning and "--client-timeout" in warning
    finally:
        for sock in held:
            sock.close()
        srv.stop()


def test_other_socket_errors_keep_their_error_line_and_traceback(caplog):
    import gunicorn.config

    from webhook.admission import serving

    gunicorn_log = serving._GunicornLog(gunicorn.config.Config())
    gunicorn_log.error_log.propagate = True
    caplog.set_level(logging.DEBUG, logger="gunicorn.error")
    for exc in (TimeoutError("The read operation timed out"),
                OSError(5, "Input/output error")):
        try:
            raise exc
        except OSError:
            gunicorn_log.exception("Socket error processing request.")
    quiet, loud = [r for r in caplog.records if r.name == "gunicorn.error"]
    assert quiet.levelno == logging.DEBUG and quiet.exc_info is None and "timed out" in quiet.getMessage()
    assert loud.levelno == logging.ERROR and loud.exc_info is not None
