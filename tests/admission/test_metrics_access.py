"""We test who may read the webhook's /metrics (per-card free shares, the certificate's expiry), through the admission
app and the local Kubernetes API server answering its TokenReviews and SubjectAccessReviews:
- from the network: no token is 401 (with a WWW-Authenticate header), an unknown token 401, a tenant's valid token
  without the right 403, and none of those answers holds a metric; a token allowed get on the URL /metrics
  (gpushard-metrics-reader's rule) gets them, and the review asked for exactly that;
- from the pod's own loopback (a port-forward) no token is needed;
- a webhook with no API credentials (a cluster file, or none found) serves the network nothing.
"""

from __future__ import annotations

import json

import pytest

from tests.fakekube import FakeKube
from webhook import authorizing
from webhook import settings as settings_mod
from webhook.admission import app as app_mod

PROMETHEUS = "system:serviceaccount:gpushard-system:gpushard-metrics-scraper"
TENANT = "system:serviceaccount:team-b:default"
NETWORK = {"REMOTE_ADDR": "10.244.1.7"}


@pytest.fixture
def kube():
    with FakeKube() as fake:
        fake.users = {"prom-token": (PROMETHEUS, ("system:serviceaccounts",)),
                      "tenant-token": (TENANT, ("system:serviceaccounts",))}
        fake.grants = [{"subject": PROMETHEUS, "verb": "get", "path": "/metrics"}]
        yield fake


def scrape(app, token: str | None = None, environ: dict | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return app.test_client().get("/metrics", headers=headers, environ_base=environ or NETWORK)


def test_only_a_token_allowed_get_metrics_reads_them_from_the_network(kube):
    reviewer = authorizing.Reviewer(kube.api_client(), authorizing.METRICS_URL)
    app = app_mod.create_app(settings_mod.Settings(), reviewer=reviewer)
    for token, status in ((None, 401), ("forged", 401), ("tenant-token", 403)):
        resp = scrape(app, token)
        body = resp.get_data(as_text=True)
        assert resp.status_code == status, (token, body)
        assert body.startswith("gpushard: ") and "gpushard_admission" not in body
    assert scrape(app).headers["WWW-Authenticate"] == 'Bearer realm="gpushard"'
    assert f'user "{TENANT}" may not get /metrics' in scrape(app, "tenant-token").get_data(as_text=True)
    resp = scrape(app, "prom-token")
    assert resp.status_code == 200 and "gpushard_admission" in resp.get_data(as_text=True)
    sent = [json.loads(b)["spec"] for m, p, b in kube.requests if p.endswith("/subjectaccessreviews")]
    assert {"user": PROMETHEUS, "groups": ["system:serviceaccounts"],
            "nonResourceAttributes": {"verb": "get", "path": "/metrics"}} in sent


def test_a_port_forward_needs_no_token_and_without_credentials_the_network_gets_nothing():
    app = app_mod.create_app(settings_mod.Settings())
    assert scrape(app, environ={"REMOTE_ADDR": "127.0.0.1"}).status_code == 200
    resp = scrape(app, "prom-token")
    assert resp.status_code == 503 and "no Kubernetes API credentials" in resp.get_data(as_text=True)
