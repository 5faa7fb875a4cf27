"""We test:
- bodies that are no AdmissionReview (not JSON, bad UTF-8, a JSON list or number, NaN or an infinite
  number, wrong apiVersion or kind, no request, no uid, a uid that is no string, nesting deeper than JSON
  decoding goes, integers over Python's digit limit) get HTTP 400 and a short `gpushard:` reason;
- an AdmissionReview the webhook cannot read (nested deeper than Python's parser goes, an integer over its
  digit limit, NaN, over the size limit, chunked or not) is answered by its uid: a denial that says why in
  enforce mode (so that the hide entry's failurePolicy Ignore never turns it into an admission without the
  hiding), a warning in audit mode; a body over the limit that names no uid gets HTTP 400;
- any garbage body (hypothesis) gets 200 or 400, never a 500, and a 200 is an AdmissionReview with the uid.
"""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.admission import objects
from webhook.admission import app as app_mod

GOOD = objects.review(objects.pod(objects.container("t", "0.5")), uid="u")


def _without(path: tuple[str, ...]) -> dict:
    review = json.loads(json.dumps(GOOD))
    node = review
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return review


def _with(path: tuple[str, ...], value: object) -> dict:
    review = json.loads(json.dumps(GOOD))
    node = review
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return review


BAD_BODIES = {
    "empty": b"",
    "not json": b"apiVersion: admission.k8s.io/v1",
    "bad utf-8": b'{"a": "\xff\xfe"}',
    "json list": b"[1, 2, 3]",
    "json number": b"42",
    "json null": b"null",
    "wrong apiVersion": json.dumps(_with(("apiVersion",), "admission.k8s.io/v1beta1")).encode(),
    "wrong kind": json.dumps(_with(("kind",), "Pod")).encode(),
    "no request": json.dumps(_without(("request",))).encode(),
    "request not a mapping": json.dumps(_with(("request",), ["x"])).encode(),
    "no uid": json.dumps(_without(("request", "uid"))).encode(),
    "empty uid": json.dumps(_with(("request", "uid"), "")).encode(),
    "uid not a string": json.dumps(_with(("request", "uid"), 12)).encode(),
    "nested too deep": b"[" * 100_000 + b"]" * 100_000,
    "infinity": b'{"apiVersion": "admission.k8s.io/v1", "n": 1e999}',
    "huge integer": b'{"apiVersion": "admission.k8s.io/v1", "n": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_a_body_that_is_no_review_is_a_400_with_a_reason(client, name):
    resp = client.post("/mutate", data=BAD_BODIES[name], content_type="application/json")
    assert resp.status_code == 400, resp.get_data(as_text=True)
    text = resp.get_data(as_text=True)
    assert text.startswith("gpushard:") and len(text) < 200


@pytest.mark.parametrize("path, value", [
    (("request", "kind"), None), (("request", "kind"), "Pod"), (("request", "kind"), {"kind": 5}),
    (("request", "object"), "junk"), (("request", "object", "spec", "containers"), {"a": 1}),
    (("request", "object", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "1e999999"),
    (("request", "object", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), 1e308),
    (("request", "object", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "x" * 10_000),
    (("request", "object", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), [0.5]),
    (("request", "object", "spec", "containers", 0, "env"), "not a list"),
    (("request", "object", "spec", "containers", 0, "env"), [1, "a", None]),
    (("request", "object", "metadata"), "not a mapping"),
    (("request", "object", "metadata", "annotations"), ["x"]),
    (("request", "operation"), 7), (("request", "dryRun"), "yes"),
])
def test_an_unreadable_object_in_a_valid_review_is_answered(client, path, value):
    resp = client.post("/mutate", data=json.dumps(_with(path, value)), content_type="application/json")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    response = objects.response_of(resp.get_json(), "u")
    if not response["allowed"]:
        assert response["status"]["code"] in (400, 403)
    else:
        objects.assert_api_server_accepts(objects.patched(GOOD["request"]["object"] if path[1] != "object"
                                                          else _with(path, value)["request"]["object"], response))


def _deep(levels: int) -> bytes:
    return json.dumps(GOOD).replace('"metadata": {', '"metadata": {"managedFields": [{"fieldsV1": '
                                    + '{"f:a": ' * levels + "1" + "}" * levels + '}], ', 1).encode()


UNREADABLE_REVIEWS = {
    # Deeper than the parser goes at any recursion limit this process may have (a library may raise it).
    "nested 5,000 levels in managedFields": (_deep(5000), "over 500 levels deep at "
                                             "metadata.managedFields[0].fieldsV1.f:a.f:a..."),
    "nested 50,000 levels": (_deep(50000), "over 500 levels deep"),
    "an integer over Python's digit limit": (json.dumps(GOOD).replace('"metadata": {', '"metadata": {"n": '
                                                                      + "9" * 5000 + ", ", 1).encode(), "not JSON"),
    "NaN": (json.dumps(_with(("request", "object", "spec", "containers", 0, "resources"),
                             {"limits": {"nvidia.com/gpu": float("nan")}})).encode(), "not JSON"),
    "over the limit": (json.dumps(_with(("request", "object", "metadata", "annotations"),
                                        {"big": "<" * (app_mod.MAX_BODY + 1)})).encode(), "over the 32 MiB"),
}


@pytest.mark.parametrize("name", sorted(UNREADABLE_REVIEWS))
@pytest.mark.parametrize("chunked", [False, True])
def test_a_review_that_cannot_be_read_is_denied_by_its_uid(client, name, chunked):
    body, said = UNREADABLE_REVIEWS[name]
    for path, allowed in (("/mutate", False), ("/audit", True)):
        sent = {"input_stream": io.BytesIO(body)} if chunked else {"data": body}
        resp = client.post(path, content_type="application/json", **sent)
        assert resp.status_code == 200, resp.get_data(as_text=True)[:300]
        response = objects.response_of(resp.get_json(), "u")
        assert response["allowed"] is allowed
        text = response["warnings"][0] if allowed else response["status"]["message"]
        assert text.startswith("gpushard: ") and said in text, text
        assert allowed or response["status"]["code"] == 400


def test_a_body_over_the_limit_without_a_uid_is_400(client):
    for big in (b" " * (app_mod.MAX_BODY + 1), b'{"x": "' + b"y" * (app_mod.MAX_BODY + 1) + b'"}'):
        resp = client.post("/mutate", data=big, content_type="application/json")
        assert resp.status_code == 400
        assert resp.get_data(as_text=True).startswith("gpushard:")


def test_a_body_just_under_the_limit_is_read(client):
    review = _with(("request", "object", "metadata", "annotations"), {"big": "x" * (app_mod.MAX_BODY - 4096)})
    resp = client.post("/mutate", data=json.dumps(review), content_type="application/json")
    assert resp.status_code == 200
    objects.response_of(resp.get_json(), "u")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode())))
def test_garbage_bodies_never_get_a_500(client, body):
    for path in ("/mutate", "/audit"):
        resp = client.post(path, data=body, content_type="application/json")
        assert resp.status_code in (200, 400), (resp.status_code, body)
