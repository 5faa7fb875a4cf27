"""The admission server and the DeviceClasses of other drivers that serve an extended resource.

We test, through the app's test client:
- /mutate denies a pod and a Deployment that would hold shares while a class serves gpushard's shares name,
  with the message naming the class, the field and the value (403), and answers a fraction with a patch
  and the warning while a class serves nvidia.com/gpu; /audit admits with the finding as a warning and an
  audit annotation;
- the classes are read on every review: a class appearing between two reviews changes the second answer;
- a classes view that fails is logged, and until the classes are read a pod that would hold shares is refused
  with a message that says why (a plain pod is not, nor anything in audit mode);
- /readyz waits for the classes' first list as for the view's, up to the same grace;
- `gpushard serve --cluster FILE`'s app (serving.build_app) takes the file's deviceClasses, and a bad entry
  stops it before it serves.
"""

from __future__ import annotations

import json

import pytest

from tests.admission import objects
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.admission import reviews, serving
from webhook.cluster import deviceclasses, static
from webhook.core import extended

TAKES_SHARES = extended.Served("gpu.example.com", "gpu.example.com")
NVIDIA = extended.Served("gpu.nvidia.com", "gpu.nvidia.com")


class Classes:
    """What a test says the cluster's DeviceClasses serve, changeable between reviews."""

    def __init__(self, served: dict | None = None):
        self.now = dict(served or {})

    def served(self):
        return extended.frozen(dict(self.now))

    def synced(self):
        return True


def post(client, path: str, review: dict) -> dict:
    resp = client.post(path, data=json.dumps(review), content_type="application/json")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return objects.response_of(resp.get_json(), review["request"]["uid"])


@pytest.fixture
def make_client(view):
    def make(classes):
        return app_mod.create_app(settings_mod.Settings(), view, classes=classes).test_client()
    return make


@pytest.mark.parametrize("obj", [objects.pod(objects.container("train", "0.25")),
                                 objects.deployment(objects.container("serve", "25", resource="gpushard.io/gpu"))])
def test_mutate_denies_what_would_hold_shares_while_another_driver_serves_them(make_client, obj):
    client = make_client(Classes({"gpushard.io/gpu": TAKES_SHARES}))
    response = post(client, "/mutate", objects.review(obj))
    assert response["allowed"] is False and response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith("gpushard: DeviceClass gpu.example.com has spec.extendedResourceName gpushard.io/gpu, "
                              "a resource gpushard writes")
    assert "remove extendedResourceName from that class, or give gpushard other resource names" in message
    assert "extended-resource-taken" in response["auditAnnotations"]


def test_mutate_rewrites_a_fraction_with_a_warning_while_another_driver_serves_its_name(make_client):
    client = make_client(Classes({"nvidia.com/gpu": NVIDIA}))
    obj = objects.pod(objects.container("train", "0.25"))
    response = post(client, "/mutate", objects.review(obj))
    assert response["allowed"] is True
    stored = objects.patched(obj, response)
    objects.assert_api_server_accepts(stored)
    assert "nvidia.com/gpu" not in stored["spec"]["containers"][0]["resources"]["limits"]
    assert ("gpushard: DeviceClass gpu.nvidia.com serves nvidia.com/gpu too; the fraction became gpushard.io/gpu "
            "shares") in response["warnings"]


def test_audit_admits_with_the_finding_as_a_warning(make_client):
    client = make_client(Classes({"gpushard.io/gpu": TAKES_SHARES}))
    response = post(client, "/audit", objects.review(objects.pod(objects.container("train", "0.25"))))
    assert response["allowed"] is True and "patch" not in response
    assert any(w.startswith("gpushard: DeviceClass gpu.example.com has spec.extendedResourceName gpushard.io/gpu")
               for w in response["warnings"])
    assert "enforce mode denies the pod" in response["auditAnnotations"]["extended-resource-taken"]


def test_the_classes_are_read_on_every_review(make_client):
    classes = Classes()
    client = make_client(classes)
    assert post(client, "/mutate", objects.review(objects.pod(objects.container("a", "0.5"))))["allowed"] is True
    classes.now["gpushard.io/card-1"] = extended.Served("card.example.com")
    response = post(client, "/mutate", objects.review(objects.pod(objects.container("a", "0.5"))))
    assert response["allowed"] is False and "DeviceClass card.example.com" in response["status"]["message"]
    # A pod asking no GPU is none of this.
    assert post(client, "/mutate", objects.review(objects.pod(objects.container("web"))))["allowed"] is True


class _Unsynced(Classes):
    ready = False

    def synced(self):
        return self.ready


class _Broken:
    def served(self):
        raise RuntimeError("boom")

    def synced(self):
        raise RuntimeError("boom")


def test_a_failing_classes_view_is_logged_and_no_pod_holds_shares_meanwhile(make_client, caplog):
    client = make_client(_Broken())
    with caplog.at_level("ERROR", logger="gpushard.admission"):
        response = post(client, "/mutate", objects.review(objects.pod(objects.container("a", "0.5"))))
    assert response["allowed"] is False and response["status"]["message"] == reviews.UNKNOWN_CLASSES
    assert any("the DeviceClasses view failed" in r.getMessage() for r in caplog.records)
    assert post(client, "/mutate", objects.review(objects.pod(objects.container("web"))))["allowed"] is True


def test_until_the_classes_are_read_a_pod_that_would_hold_shares_is_refused(make_client):
    classes = _Unsynced()
    client = make_client(classes)
    gpu = objects.review(objects.pod(objects.container("a", "0.5")))
    response = post(client, "/mutate", gpu)
    assert response["allowed"] is False and response["status"]["message"] == reviews.UNKNOWN_CLASSES
    assert post(client, "/audit", gpu)["allowed"] is True
    assert post(client, "/mutate", objects.review(objects.pod(objects.container("web"))))["allowed"] is True
    classes.ready = True
    assert post(client, "/mutate", gpu)["allowed"] is True


def test_serve_with_a_cluster_file_takes_its_device_classes(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(objects.CLUSTER_YAML + "deviceClasses:\n"
                    "- {name: gpu.example.com, extendedResourceName: gpushard.io/gpu, driver: gpu.example.com}\n")
    app = serving.build_app(None, str(path))
    classes = app.extensions["gpushard"]["classes"]
    assert isinstance(classes, deviceclasses.Fixed)
    assert dict(classes.served()) == {"gpushard.io/gpu": TAKES_SHARES}
    response = post(app.test_client(), "/mutate", objects.review(objects.pod(objects.container("a", "0.5"))))
    assert response["allowed"] is False
    path.write_text(objects.CLUSTER_YAML + "deviceClasses: [{name: x, extendedResourceName: 5}]\n")
    with pytest.raises(static.ViewFileError, match=r"deviceClasses\[0\]\.extendedResourceName: .*got 5"):
        serving.build_app(None, str(path))




def test_readyz_waits_for_the_classes_first_list(view):
    now = [100.0]
    client = app_mod.create_app(settings_mod.Settings(), view, sync_grace=30, clock=lambda: now[0],
                                classes=_Unsynced()).test_client()
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "not synced" in ready.get_data(as_text=True)
    now[0] += 30
    assert client.get("/readyz").status_code == 200
    synced = app_mod.create_app(settings_mod.Settings(), view, classes=Classes()).test_client()
    assert synced.get("/readyz").get_data(as_text=True) == "ok: cluster view synced\n"
    assert app_mod.create_app(settings_mod.Settings(), view, sync_grace=30, clock=lambda: now[0],
                              classes=_Broken()).test_client().get("/readyz").status_code == 503
