"""The admission server's answers, byte for byte, as recorded from an earlier version of the server.

We test, for a fixed sequence of requests sent to one app over one static view (its clock
stopped, so every remembered choice still counts): every golden manifest reviewed in enforce and
audit mode, a mix of pods and Deployments like the bench's (fractional, whole card, no GPU, bad
quantities, dry runs, non-ASCII text, integers past 64 bits, UPDATEs, DELETEs), bodies that are
no AdmissionReview, and requests that are no review at all (wrong method or path, a body over the
limit, a body cut short, a chunked body):

- the status, Content-Type and body of each answer are those recorded in recorded_answers.json;
- so are the denial and error log lines, and the admissions counter by outcome, kind and mode.

After a deliberate change of an answer, record again on the new code and review the diff:

    python -m tests.admission.test_recorded_answers --record
"""

from __future__ import annotations

import base64
import io
import json
import logging
import pathlib
import sys

import pytest
import yaml

from tests.admission import objects
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.cluster import static
from webhook.core import names

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
RECORDED = pathlib.Path(__file__).resolve().parent / "recorded_answers.json"
MAX_BODY = 8 * 1024 * 1024


def _review(obj: dict | None, kind: str, uid: str, *, operation: str = "CREATE", dry_run: bool = False,
            old: dict | None = None, namespace: str = "ml") -> dict:
    group = "apps" if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet") else (
        "batch" if kind in ("Job", "CronJob") else "")
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": group, "version": "v1", "kind": kind},
        "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
        "namespace": namespace, "operation": operation, "userInfo": {"username": "system:serviceaccount:ml:ci"},
        "object": obj, "oldObject": old, "dryRun": dry_run}}


def _container(name: str, gpu: str | None = None) -> dict:
    c = {"name": name, "image": "nvcr.io/nvidia/pytorch:24.05-py3", "command": ["python", "train.py"],
         "env": [{"name": "EPOCHS", "value": "10"}],
         "resources": {"limits": {"cpu": "4", "memory": "16Gi"}, "requests": {"cpu": "2", "memory": "8Gi"}}}
    if gpu is not None:
        c["resources"]["limits"]["nvidia.com/gpu"] = gpu
        c["resources"]["requests"]["nvidia.com/gpu"] = gpu
    return c


def _pod(*containers: dict, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "train-", "namespace": "ml", "labels": labels or {"app": "train"}},
            "spec": {"containers": list(containers), "restartPolicy": "Never",
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}


def _deployment(gpu: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "serve", "namespace": "ml"},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "serve"}},
                     "template": {"metadata": {"labels": {"app": "serve"}},
                                  "spec": {"containers": [_container("serve", gpu)]}}}}


def requests() -> list[dict]:
    """The sequence: each item a request as the werkzeug test client takes it, plus a name."""
    out: list[dict] = []

    def post(name: str, review: object, path: str = "/mutate") -> None:
        body = review if isinstance(review, bytes) else json.dumps(review).encode()
        out.append({"name": name, "method": "POST", "path": path, "body": body})

    for manifest in sorted(GOLDEN.glob("*.yaml")):
        if manifest.name.endswith(".config.yaml"):
            continue
        docs = [d for d in yaml.safe_load_all(manifest.read_text()) if isinstance(d, dict)]
        for j, doc in enumerate(docs):
            kind = doc.get("kind")
            if kind != names.POD_KIND and kind not in names.TEMPLATE_PATHS:
                continue
            for path in ("/mutate", "/audit"):
                post(f"{manifest.stem}#{j}{path}", _review(doc, kind, f"{manifest.stem}-{j}-{path[1:]}"), path)

    for i, q in enumerate(["0.05", "0.1", "0.25", "250m", "0.5", "0.333", "1", "2", "1.5", "-1", "lots", "0"]):
        for dry in (False, True):
            post(f"fraction {q} dry={dry}", _review(_pod(_container("train", q), _container("sidecar")), "Pod",
                                                    f"pod-{i}-{dry}", dry_run=dry))
    post("no GPU", _review(_pod(_container("web"), _container("proxy")), "Pod", "plain"))
    post("non-ASCII", _review(_pod(_container("train", "0.25"), labels={"team": "équipe-ü-\u2603"}), "Pod",
                              "non-ascii"))
    big = _pod(_container("train", "0.25"))
    big["metadata"]["annotations"] = {"n": 123456789012345678901234567890}
    post("integer past 64 bits", _review(big, "Pod", "bigint"))
    post("Deployment", _review(_deployment("0.25"), "Deployment", "deploy"))
    post("Deployment audit", _review(_deployment("0.5"), "Deployment", "deploy-audit"), "/audit")
    post("Deployment bad", _review(_deployment("lots"), "Deployment", "deploy-bad"))
    post("audit pod", _review(_pod(_container("train", "0.25")), "Pod", "audit-pod"), "/audit")
    post("audit bad pod", _review(_pod(_container("train", "lots")), "Pod", "audit-bad"), "/audit")
    rewritten = _pod(_container("train", "0.25"))
    post("UPDATE", _review(rewritten, "Pod", "update", operation="UPDATE", old=rewritten))
    post("DELETE", _review(None, "Pod", "delete", operation="DELETE", old=rewritten))
    post("CONNECT", _review(None, "Pod", "connect", operation="CONNECT"))
    post("unknown operation", _review(_pod(), "Pod", "op", operation="PATCH"))
    odd = _review(_pod(), "Pod", "nokind")
    odd["request"]["kind"] = {}
    post("no kind.kind", odd)
    post("ConfigMap", _review({"apiVersion": "v1", "kind": "ConfigMap", "data": {}}, "ConfigMap", "cm"))
    post("object not a mapping", _review(["x"], "Pod", "list-object"))  # type: ignore[arg-type]
    for name, body in (("not JSON", b"{nope"), ("JSON array", b"[1,2]"), ("NaN", b'{"a": NaN}'),
                       ("wrong apiVersion", b'{"apiVersion":"v1","kind":"AdmissionReview","request":{"uid":"u"}}'),
                       ("no request", b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}'),
                       ("no uid", b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{}}'),
                       ("bad UTF-8", b'{"a":"\xff"}'), ("empty", b"")):
        post(name, body)
        post(f"{name} audit", body, "/audit")
    out.append({"name": "GET /mutate", "method": "GET", "path": "/mutate", "body": b""})
    out.append({"name": "POST /nope", "method": "POST", "path": "/nope", "body": b"{}"})
    out.append({"name": "POST /mutate/", "method": "POST", "path": "/mutate/", "body": b"{}"})
    out.append({"name": "GET /healthz", "method": "GET", "path": "/healthz", "body": b""})
    out.append({"name": "GET /readyz", "method": "GET", "path": "/readyz", "body": b""})
    out.append({"name": "PUT /audit", "method": "PUT", "path": "/audit", "body": b"{}"})
    fine = json.dumps(_review(_pod(_container("train", "0.25")), "Pod", "query")).encode()
    out.append({"name": "query string", "method": "POST", "path": "/mutate?timeout=5s", "body": fine})
    out.append({"name": "over the limit", "method": "POST", "path": "/mutate", "body": b" " * (MAX_BODY + 1)})
    out.append({"name": "length of 5,000 digits", "method": "POST", "path": "/mutate", "body": fine,
                "length": "1" * 5000})
    out.append({"name": "length with leading zeros", "method": "POST", "path": "/audit", "body": fine,
                "length": "0000000000" + str(len(fine))})
    out.append({"name": "cut short", "method": "POST", "path": "/mutate", "body": fine[:100],
                "length": len(fine)})
    out.append({"name": "chunked", "method": "POST", "path": "/mutate", "body": fine, "chunked": True})
    out.append({"name": "chunked over the limit", "method": "POST", "path": "/audit",
                "body": b" " * (MAX_BODY + 1), "chunked": True})
    return out


def _app():
    view = static.StaticView(static.parse(yaml.safe_load(objects.CLUSTER_YAML), 100, "cluster.yaml"),
                             clock=lambda: 0.0)
    return app_mod.create_app(settings_mod.Settings(), view)


def _send(client, item: dict):
    environ: dict = {}
    body = item["body"]
    if item.get("chunked"):
        # As gunicorn hands a chunked body over: no length, and a stream that ends.
        environ = {"wsgi.input_terminated": True, "HTTP_TRANSFER_ENCODING": "chunked"}
        return client.open(item["path"], method=item["method"], input_stream=io.BytesIO(body),
                           content_type="application/json", environ_overrides=environ)
    if "length" in item:
        environ = {"CONTENT_LENGTH": str(item["length"])}
        return client.open(item["path"], method=item["method"], input_stream=io.BytesIO(body),
                           content_type="application/json", environ_overrides=environ)
    return client.open(item["path"], method=item["method"], data=body, content_type="application/json")


def _counters(app) -> dict[str, float]:
    text = app.extensions["gpushard"]["metrics"].exposition()[0].decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("gpushard_admissions_total") or line.startswith("gpushard_admission_seconds_count")}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name} {record.getMessage()}")


def answers(app=None) -> dict:
    """Every request of the sequence sent to one app, in order: what came back and was logged."""
    app = app or _app()
    client = app.test_client()
    handler = _Lines()
    logger = logging.getLogger("gpushard")
    logger.addHandler(handler)
    try:
        out = []
        for item in requests():
            resp = _send(client, item)
            data = resp.get_data()
            out.append({"name": item["name"], "status": resp.status_code,
                        "content_type": resp.headers.get("Content-Type"),
                        "content_length": resp.headers.get("Content-Length"),
                        "body": base64.b64encode(data).decode() if len(data) < 100_000 else None})
    finally:
        logger.removeHandler(handler)
    return {"answers": out, "log": handler.lines, "counters": _counters(app)}


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


@pytest.fixture(scope="module")
def current() -> dict:
    return answers()


def test_the_sequence_is_the_recorded_one(recorded, current):
    assert [a["name"] for a in current["answers"]] == [a["name"] for a in recorded["answers"]]


@pytest.mark.parametrize("index", range(len(requests())))
def test_each_answer_is_byte_for_byte_the_recorded_one(recorded, current, index):
    want, got = recorded["answers"][index], current["answers"][index]
    assert got["name"] == want["name"]
    assert (got["status"], got["content_type"], got["content_length"]) == (
        want["status"], want["content_type"], want["content_length"]), got["name"]
    assert got["body"] == want["body"], (got["name"], base64.b64decode(got["body"] or "")[:2000],
                                         base64.b64decode(want["body"] or "")[:2000])


def test_the_log_lines_are_the_recorded_ones(recorded, current):
    assert current["log"] == recorded["log"]


def test_the_admission_counters_are_the_recorded_ones(recorded, current):
    assert current["counters"] == recorded["counters"]
    assert any(value > 0 for key, value in current["counters"].items() if 'outcome="patched"' in key)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python -m tests.admission.test_recorded_answers --record")
    RECORDED.write_text(json.dumps(answers(), indent=1, sort_keys=True) + "\n")
    print(f"recorded {RECORDED}")
