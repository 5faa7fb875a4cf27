"""We test:
- /mutate rewrites a fractional pod and a Deployment by JSONPatch, and the patched objects pass the
  API server's checks (integer extended resources, requests == limits);
- an already rewritten pod, a pod without GPUs' siblings, UPDATE and DELETE get no or empty patches;
- denials carry code 403 (policy) or 400 (unreadable object) and a `gpushard:` message;
- /audit answers with warnings and audit annotations, never a patch, never a denial;
- the answer's uid is the request's, always;
- a non-dry-run pod placement is remembered by the view, a dry run leaves no trace;
- an exception inside the core still gives a well-formed answer (denial in enforce, warning in audit);
- /healthz, /readyz (synced, not yet, or given up waiting for), /metrics (counters by outcome, kind and
  mode; latency histogram);
- unknown paths and methods.
"""

from __future__ import annotations

import json

import pytest

from tests.admission import objects
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.admission import reviews
from webhook.core import decisions


def post(client, path: str, review: dict) -> dict:
    resp = client.post(path, data=json.dumps(review), content_type="application/json")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.mimetype == "application/json"
    return objects.response_of(resp.get_json(), review["request"]["uid"])


def test_mutate_rewrites_a_fractional_pod(client):
    obj = objects.pod(objects.container("train", "0.25"), objects.container("log"))
    review = objects.review(obj)
    response = post(client, "/mutate", review)
    assert response["allowed"] is True
    new = objects.patched(obj, response)
    objects.assert_api_server_accepts(new)
    train, log = new["spec"]["containers"]
    card = new["metadata"]["annotations"]["gpushard.io/card"]
    assert objects.shares_of(train) == {"gpushard.io/gpu": 25, f"gpushard.io/card-{card}": 25}
    assert objects.env_of(train) == {"NVIDIA_VISIBLE_DEVICES": card, "GPUSHARD_FRACTION": "0.25"}
    assert objects.env_of(log) == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert new["metadata"]["labels"]["gpushard.io/shared"] == "true"
    assert new["metadata"]["annotations"]["gpushard.io/shares"] == "25"
    # binpack over the view: node-b card 0 (90 used) has no room for 25; node-a card 0 (40) is fullest.
    assert card == "0"


def test_mutate_rewrites_a_deployment_template_without_choosing_a_card(client):
    obj = objects.deployment(objects.container("serve", "250m"))
    response = post(client, "/mutate", objects.review(obj))
    new = objects.patched(obj, response)
    objects.assert_api_server_accepts(new)
    c = new["spec"]["template"]["spec"]["containers"][0]
    assert objects.shares_of(c) == {"gpushard.io/gpu": 25}
    assert "env" not in c
    assert "gpushard.io/card" not in (new["spec"]["template"]["metadata"].get("annotations") or {})


def test_rounding_comes_back_as_a_warning_and_audit_annotation(client):
    response = post(client, "/mutate", objects.review(objects.pod(objects.container("a", "0.333"))))
    assert any("34" in w for w in response["warnings"])
    assert "rounded" in response["auditAnnotations"]


def test_a_rewritten_pod_comes_back_without_a_patch(client):
    obj = objects.pod(objects.container("train", "0.5"))
    first = objects.patched(obj, post(client, "/mutate", objects.review(obj)))
    again = post(client, "/mutate", objects.review(first))
    assert again["allowed"] is True
    assert "patch" not in again and "patchType" not in again


def test_update_and_delete_of_a_pod_are_allowed_unchanged(client):
    obj = objects.pod(objects.container("train", "0.5"))
    for op in ("UPDATE", "DELETE", "CONNECT"):
        response = post(client, "/mutate", objects.review(obj if op != "DELETE" else None, kind="Pod", operation=op))
        assert response["allowed"] is True and "patch" not in response


def test_a_kind_gpushard_ignores_is_allowed(client):
    response = post(client, "/mutate", objects.review({"kind": "ConfigMap", "data": {}}, kind="ConfigMap"))
    assert response == {"uid": response["uid"], "allowed": True}


@pytest.mark.parametrize("gpu, rule", [("1.5", "fraction-above-one"), ("2", "multi-card"), ("-1", "bad-quantity"),
                                       ("lots", "bad-quantity"), ("1e999999", "bad-quantity"),
                                       ("9" * 10000, "bad-quantity")])
def test_policy_denials_are_403_with_a_gpushard_message(client, gpu, rule):
    response = post(client, "/mutate", objects.review(objects.pod(objects.container("train", gpu))))
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert response["status"]["message"].startswith("gpushard:")
    assert len(response["status"]["message"]) <= reviews.TEXT_MAX
    assert rule in response["auditAnnotations"]


def test_requests_different_from_limits_are_denied(client):
    c = objects.container("train")
    c["resources"] = {"limits": {"nvidia.com/gpu": "0.5"}, "requests": {"nvidia.com/gpu": "0.25"}}
    response = post(client, "/mutate", objects.review(objects.pod(c)))
    assert response["allowed"] is False and response["status"]["code"] == 403


@pytest.mark.parametrize("obj", [
    "a string", ["a", "list"], 7, None,
    {"kind": "Pod", "spec": "no"},
    {"kind": "Pod", "spec": {"containers": "not a list"}},
    {"kind": "Pod", "spec": {"containers": ["not a mapping"]}},
    {"kind": "Pod", "spec": {"containers": [{"name": "c", "resources": ["x"]}]}},
    {"kind": "Pod", "spec": {"containers": [{"name": "c", "resources": {"limits": "x"}}]}},
])
def test_unreadable_objects_are_400_denials(client, obj):
    response = post(client, "/mutate", objects.review(obj, kind="Pod"))
    assert response["allowed"] is False
    assert response["status"]["code"] == 400
    assert response["status"]["message"].startswith("gpushard: cannot read")


def test_unreadable_objects_are_findings_in_audit_mode(client):
    response = post(client, "/audit", objects.review({"kind": "Pod", "spec": {"containers": 3}}, kind="Pod"))
    assert response["allowed"] is True
    assert response["warnings"] and response["auditAnnotations"]["unreadable"].startswith("gpushard:")


def test_a_deeply_nested_object_is_read_or_refused_not_crashed(client):
    obj = objects.pod(objects.container("train", "0.5"))
    deep: dict = {}
    node = deep
    for _ in range(400):
        node["x"] = {}
        node = node["x"]
    obj["metadata"]["annotations"] = {"deep": "x"}
    obj["spec"]["containers"][0]["extra"] = deep
    response = post(client, "/mutate", objects.review(obj))
    assert response["allowed"] is True
    objects.assert_api_server_accepts(objects.patched(obj, response))


def test_audit_warns_and_annotates_but_never_patches_or_denies(client):
    pod = objects.pod(objects.container("train", "0.333"), objects.container("log"))
    response = post(client, "/audit", objects.review(pod))
    assert response["allowed"] is True
    assert "patch" not in response and "patchType" not in response
    assert response["warnings"] and all(w.startswith("gpushard:") for w in response["warnings"])
    assert {"rounded", "fraction-unrewritten", "unhidden"} <= set(response["auditAnnotations"])
    denied = post(client, "/audit", objects.review(objects.pod(objects.container("train", "3"))))
    assert denied["allowed"] is True and "multi-card" in denied["auditAnnotations"]


def test_the_answer_carries_the_request_uid(client):
    for path in ("/mutate", "/audit"):
        for obj in (objects.pod(objects.container("t", "0.5")), objects.pod(objects.container("t", "7")),
                    objects.deployment(objects.container("t", "0.1")), "junk"):
            review = objects.review(obj, kind="Pod" if obj == "junk" else None, uid=f"uid-{path}-{id(obj)}")
            post(client, path, review)


def test_a_placement_is_remembered_and_a_dry_run_is_not(client, view):
    def used() -> dict:
        return {(n.name, c.index): c.used for n in view.snapshot().nodes for c in n.cards}

    before = used()
    post(client, "/mutate", objects.review(objects.pod(objects.container("t", "0.5")), dry_run=True))
    assert used() == before
    response = post(client, "/mutate", objects.review(objects.pod(objects.container("t", "0.5"))))
    card = int(objects.patched(objects.pod(objects.container("t", "0.5")), response)
               ["metadata"]["annotations"]["gpushard.io/card"])
    after = used()
    assert sum(after.values()) == sum(before.values()) + 50
    assert any(after[k] == before[k] + 50 for k in after if k[1] == card)


def test_a_pod_without_a_view_is_still_admitted(view):
    client = app_mod.create_app(settings_mod.Settings(), None).test_client()
    obj = objects.pod(objects.container("t", "0.5"))
    response = post(client, "/mutate", objects.review(obj))
    assert response["allowed"] is True
    objects.assert_api_server_accepts(objects.patched(obj, response))
    assert client.get("/readyz").status_code == 200


class _BrokenView:
    """A view that fails on every call, as a view with a bug would."""

    def snapshot(self):
        raise RuntimeError("boom")

    def synced(self):
        raise RuntimeError("boom")

    def remember(self, node, card, shares):
        raise RuntimeError("boom")


def test_a_failing_view_still_gives_an_answer():
    client = app_mod.create_app(settings_mod.Settings(), _BrokenView()).test_client()
    response = post(client, "/mutate", objects.review(objects.pod(objects.container("t", "0.5"))))
    assert response["allowed"] is True
    assert client.get("/readyz").status_code == 503


def test_an_internal_error_is_an_explicit_denial_in_enforce_and_a_warning_in_audit(client, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    # The core's entry point stands in for any bug inside it; no library internals are touched.
    monkeypatch.setattr(decisions, "decide", broken)
    response = post(client, "/mutate", objects.review(objects.pod(objects.container("t", "0.5")), uid="bug"))
    assert response["allowed"] is False and response["status"]["code"] == 500
    assert "internal error" in response["status"]["message"]
    audit = post(client, "/audit", objects.review(objects.pod(objects.container("t", "0.5")), uid="bug"))
    assert audit["allowed"] is True and "internal error" in audit["warnings"][0]
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'gpushard_admissions_total{kind="Pod",mode="enforce",outcome="error"} 1.0' in metrics


def test_health_endpoints(client):
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 200 and "synced" in ready.get_data(as_text=True)


class _UnsyncedView:
    def synced(self):
        return False

    def snapshot(self):
        return None


def test_readyz_says_when_the_view_has_not_synced():
    now = [100.0]
    client = app_mod.create_app(settings_mod.Settings(), _UnsyncedView(), sync_grace=30,
                                clock=lambda: now[0]).test_client()
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.get_data(as_text=True).startswith("gpushard:") and "synced" in ready.get_data(as_text=True)
    assert client.get("/healthz").status_code == 200
    # A view that never syncs must not keep the webhook out of service for good.
    now[0] += 30
    ready = client.get("/readyz")
    assert ready.status_code == 200 and "has not synced" in ready.get_data(as_text=True)


def test_metrics_count_outcomes_by_kind_and_mode(client):
    post(client, "/mutate", objects.review(objects.pod(objects.container("t", "0.5"))))
    post(client, "/mutate", objects.review(objects.pod(objects.container("t", "5"))))
    post(client, "/mutate", objects.review(objects.pod(objects.container("t"))))
    post(client, "/mutate", objects.review(objects.deployment(objects.container("t", "0.5"))))
    post(client, "/audit", objects.review(objects.pod(objects.container("t", "0.5"))))
    post(client, "/mutate", objects.review({"spec": 1}, kind="Pod"))
    client.post("/mutate", data=b"not json")
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.mimetype == "text/plain"
    text = resp.get_data(as_text=True)
    for line in ('gpushard_admissions_total{kind="Pod",mode="enforce",outcome="patched"} 2.0',
                 'gpushard_admissions_total{kind="Pod",mode="enforce",outcome="denied"} 1.0',
                 'gpushard_admissions_total{kind="Deployment",mode="enforce",outcome="patched"} 1.0',
                 'gpushard_admissions_total{kind="Pod",mode="audit",outcome="allowed"} 1.0',
                 'gpushard_admissions_total{kind="Pod",mode="enforce",outcome="invalid"} 1.0',
                 'gpushard_admissions_total{kind="unknown",mode="enforce",outcome="invalid"} 1.0',
                 'gpushard_admission_seconds_count{mode="enforce"} 6.0',
                 'gpushard_admission_seconds_count{mode="audit"} 1.0'):
        assert line in text, line


def test_odd_kinds_do_not_grow_the_metrics(client):
    for i in range(5):
        post(client, "/mutate", objects.review({"kind": f"Odd{i}"}, kind=f"Odd{i}"))
    text = client.get("/metrics").get_data(as_text=True)
    assert 'kind="other"' in text and "Odd" not in text


def test_unknown_paths_and_methods(client):
    assert client.get("/mutate").status_code == 405
    missing = client.post("/nope", data=b"{}")
    assert missing.status_code == 404 and missing.get_data(as_text=True).startswith("gpushard:")


def test_two_apps_keep_separate_metrics(view):
    a = app_mod.create_app(settings_mod.Settings(), view).test_client()
    b = app_mod.create_app(settings_mod.Settings(), view).test_client()
    post(a, "/mutate", objects.review(objects.pod(objects.container("t", "0.5"))))
    assert 'outcome="patched"' in a.get("/metrics").get_data(as_text=True)
    assert 'outcome="patched"' not in b.get("/metrics").get_data(as_text=True)


def test_reviews_answer_is_plain_data():
    request = reviews.parse(json.dumps(objects.review(objects.pod(), uid="x")).encode())
    answer = reviews.answer(request, "enforce", settings_mod.Settings().policy, None)
    assert answer.review["response"]["uid"] == "x" and answer.kind == "Pod"


def test_the_wsgi_target_builds_an_app_from_the_environment(monkeypatch, cluster_file, tmp_path):
    from webhook import wsgi

    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nsharesPerCard: 10\n")
    monkeypatch.setenv("GPUSHARD_CONFIG", str(config))
    monkeypatch.setenv("GPUSHARD_CLUSTER", str(cluster_file))
    client = wsgi.create().test_client()
    obj = objects.pod(objects.container("t", "0.25"))
    new = objects.patched(obj, post(client, "/mutate", objects.review(obj)))
    assert objects.shares_of(new["spec"]["containers"][0])["gpushard.io/gpu"] == 3  # ceil(0.25 x 10)
