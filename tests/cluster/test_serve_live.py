"""We test the real `gpushard serve` with the live view, end to end: two gunicorn workers, no
cluster file, a kubeconfig pointing at a local server that speaks the Kubernetes API:
- every worker lists and watches the API from the kubeconfig and reports the view synced on /readyz;
- cards are chosen over the live view (the full card is passed over), with no fallback warning;
- a change in the cluster reaches the choice without a restart.
"""

from __future__ import annotations

import json
import time

from tests.admission import objects
from tests.cluster import kubeobjects as o

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{url}"}}}}]
users: [{{name: tester, user: {{token: not-a-secret}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: tester}}}}]
current-context: fake
"""


def _cards(server, shares: str, count: int) -> list[tuple[int, list[str]]]:
    """Review ``count`` pods, each on a new connection (so both workers answer some)."""
    out = []
    for i in range(count):
        pod = objects.pod(objects.container("train", shares), name=f"p{i}")
        review = objects.review(pod)
        status, _, body = server.request("POST", "/mutate", json.dumps(review).encode())
        assert status == 200
        response = objects.response_of(json.loads(body), review["request"]["uid"])
        new = objects.patched(pod, response)
        out.append((int(new["metadata"]["annotations"]["gpushard.io/card"]), response.get("warnings") or []))
    return out


def test_serve_chooses_over_the_live_view(fake, certs_dir, tmp_path, monkeypatch):
    fake.put("nodes", o.node("gpu-a", {0: 100, 1: 100}))
    fake.put("pods", o.pod("big", 0, 90, "gpu-a"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(url=fake.url))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    server = objects.Server(certs_dir, tmp_path / "unused.yaml", workers=2, threads=2)
    at = server.args.index("--cluster")
    del server.args[at:at + 2]  # no cluster file: the view is the Kubernetes API
    server.start()
    try:
        deadline = time.monotonic() + 30
        answers = []
        while len(answers) < 8 or not all(b"synced" in a for a in answers[-8:]):
            assert time.monotonic() < deadline, f"the view never synced: {answers[-3:]}\n{server.output()}"
            status, _, body = server.request("GET", "/readyz")
            answers.append(body if status == 200 and b"not synced" not in body and b"has not" not in body else b"")
            time.sleep(0.05)
        # Two workers each watch the API: both list nodes and pods from the kubeconfig's server.
        lists = [p for m, p, _ in fake.requests if m == "GET" and p.startswith("/api/v1/nodes") and "watch" not in p]
        assert len(lists) >= 2

        # Card 0 holds 90 of 100 shares: a quarter goes to card 1, in either worker.
        for card, warnings in _cards(server, "0.25", 2):
            assert card == 1 and warnings == []

        # Card 1 fills up (on the API, not through the webhook); a new node's empty card 0 is next.
        fake.put("pods", o.pod("other", 1, 100, "gpu-a"))
        fake.put("nodes", o.node("gpu-b", {0: 100}))
        # Before the watch delivers that, a quarter still goes to card 1 (card 0 of gpu-a has 10 free).
        o.wait_for(lambda: _cards(server, "0.25", 1)[0][0] == 0, timeout=15, what="a worker to see gpu-b")
        time.sleep(1.0)  # the other worker's watch delivers the same events
        for card, warnings in _cards(server, "0.25", 3):
            assert card == 0 and warnings == []
    finally:
        server.stop()
