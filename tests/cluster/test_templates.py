"""We test, against the local API server and through the admission app with backend dra:
- the template a pod's claim names is made in the pod's namespace before the answer, passing the API's rules;
- it is made once per namespace and share count; one that exists already (409) is fine; after a while it is
  made sure of again, in the background (the pod that finds it due is answered without an API call), so a
  template deleted since (a namespace made again) comes back;
- a dry run makes nothing; a pod without shares makes nothing;
- when the API server fails, the pod is still admitted with a warning, and a later pass makes the template.
"""

from __future__ import annotations

import json

import pytest

from tests import fakekube
from tests.admission import objects
from webhook import settings as settings_mod
from webhook.admission import app as app_mod
from webhook.cluster import templates as templates_mod
from webhook.core import draobjects
from webhook.core import policy as policy_mod


@pytest.fixture
def api():
    with fakekube.FakeKube() as server:
        yield server


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def templates(api, clock):
    return templates_mod.Templates(api.api_client(), clock=clock)


@pytest.fixture
def client(templates):
    settings = settings_mod.Settings(policy=policy_mod.Policy(backend=policy_mod.DRA))
    return app_mod.create_app(settings, None, templates=templates).test_client()


def mutate(client, obj, **kwargs):
    review = objects.review(obj, **kwargs)
    resp = client.post("/mutate", data=json.dumps(review), content_type="application/json")
    assert resp.status_code == 200
    return objects.response_of(resp.get_json(), review["request"]["uid"])


def posts(api):
    return [p for m, p, _ in api.requests if m == "POST"]


def test_the_template_is_there_before_the_answer(api, client):
    obj = objects.pod(objects.container("train", "0.25"))
    response = mutate(client, obj)
    assert response["allowed"] and "warnings" not in response
    new = objects.patched(obj, response)
    assert new["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "gpushard-shares-25"
    stored = api.get("resourceclaimtemplates", "gpushard-shares-25", "ml")
    assert draobjects.check_claim_template(stored) == []
    assert stored["spec"] == draobjects.claim_template("ml", 25)["spec"]


def test_made_once_per_namespace_and_share_count(api, client):
    for _ in range(3):
        mutate(client, objects.pod(objects.container("train", "0.25")))
    mutate(client, objects.pod(objects.container("train", "0.5")))
    assert posts(api) == ["/apis/resource.k8s.io/v1/namespaces/ml/resourceclaimtemplates"] * 2


def test_one_that_exists_is_fine(api, client):
    api.put("resourceclaimtemplates", draobjects.claim_template("ml", 25))
    response = mutate(client, objects.pod(objects.container("train", "0.25")))
    assert response["allowed"] and "warnings" not in response


def test_dry_runs_and_pods_without_shares_make_nothing(api, client):
    mutate(client, objects.pod(objects.container("train", "0.25")), dry_run=True)
    mutate(client, objects.pod(objects.container("web")))
    assert posts(api) == []


def test_a_failing_api_server_admits_with_a_warning_and_retries(api, client, templates):
    api.fail_next = [503]
    response = mutate(client, objects.pod(objects.container("train", "0.25")))
    assert response["allowed"]
    assert response["warnings"] == ["gpushard: template ml/gpushard-shares-25 not made yet (HTTP 503); "
                                    "the pod waits until it is"]
    with pytest.raises(KeyError):
        api.get("resourceclaimtemplates", "gpushard-shares-25", "ml")
    templates.retry_pending()
    assert api.get("resourceclaimtemplates", "gpushard-shares-25", "ml")


def test_a_deleted_template_comes_back_after_the_recheck(api, client, clock, templates):
    mutate(client, objects.pod(objects.container("train", "0.25")))
    api.delete("resourceclaimtemplates", "gpushard-shares-25", "ml")  # the namespace was deleted and made again
    mutate(client, objects.pod(objects.container("train", "0.25")))
    with pytest.raises(KeyError):
        api.get("resourceclaimtemplates", "gpushard-shares-25", "ml")  # still remembered
    clock.now += 61
    before = len(posts(api))
    response = mutate(client, objects.pod(objects.container("train", "0.25")))
    # That pod is answered without waiting on the API server: the check is the background pass's.
    assert response["allowed"] and "warnings" not in response and len(posts(api)) == before
    templates.retry_pending()
    assert api.get("resourceclaimtemplates", "gpushard-shares-25", "ml")
    assert len(posts(api)) == before + 1
    mutate(client, objects.pod(objects.container("train", "0.25")))
    assert len(posts(api)) == before + 1  # made sure of again: remembered for another minute


def test_a_memory_asks_template_is_the_one_for_its_card_size(api, templates):
    """The pod sized for the L4 (23034 MiB) of examples/cluster.yaml names, and gets, the template that asks
    one card of that size; its failures are retried under that name too."""
    from pathlib import Path

    from webhook.cluster import static

    settings = settings_mod.Settings(policy=policy_mod.Policy(backend=policy_mod.DRA))
    view = static.load(Path(__file__).resolve().parents[2] / "examples" / "cluster.yaml", 100)
    client = app_mod.create_app(settings, static.StaticView(view), templates=templates).test_client()
    asking = objects.container("train")
    asking["resources"] = {"limits": {"gpushard.io/memory": "12Gi"}}
    api.fail_next = [503]
    response = mutate(client, objects.pod(asking))
    assert response["allowed"]
    assert response["warnings"] == ["gpushard: template ml/gpushard-shares-54-mib-23034 not made yet (HTTP 503); "
                                    "the pod waits until it is"]
    templates.retry_pending()
    stored = api.get("resourceclaimtemplates", "gpushard-shares-54-mib-23034", "ml")
    assert stored["spec"] == draobjects.claim_template("ml", 54, size_mib=23034)["spec"]
    new = objects.patched(objects.pod(asking), response)
    assert new["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "gpushard-shares-54-mib-23034"
