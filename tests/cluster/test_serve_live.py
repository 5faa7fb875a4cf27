"""We test the real `gpushard serve` with the live view, end to end: gunicorn with its default
workers, no cluster file, a kubeconfig pointing at a local server that speaks the Kubernetes API:
- the replica lists and watches the API once (one view, one watcher) and reports it synced on /readyz;
- cards are chosen over the live view (the full card is passed over), with no fallback warning;
- a burst of reviews on separate connections shares one memory of choices: each review sees the
  choices before it, so the nearly full card takes one pod and the rest go to the other card;
- a change in the cluster reaches the choice without a restart;
- the DeviceClasses are listed once and watched: another driver's class serving gpushard.io/gpu denies a
  fraction, one serving nvidia.com/gpu instead lets it through with a warning, without a restart;
- asking for several workers says that each tries its part of the cards first, and each worker's choices
  keep to its part (webhook/cluster/peers.py).
"""

from __future__ import annotations

import json

from tests import polling
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
    """Review ``count`` pods, each on a new connection (so any worker may answer each)."""
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


def _serve(fake, certs_dir, tmp_path, monkeypatch, *extra: str):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(url=fake.url))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    server = objects.Server(certs_dir, tmp_path / "unused.yaml", *extra, threads=4)
    at = server.args.index("--cluster")
    del server.args[at:at + 2]  # no cluster file: the view is the Kubernetes API
    at = server.args.index("--workers")
    del server.args[at:at + 2]  # serve's own default
    return server.start()


def _wait_synced(server) -> None:
    answers = []

    def synced() -> bool:
        status, _, body = server.request("GET", "/readyz")
        answers.append(body if status == 200 and b"not synced" not in body and b"has not" not in body else b"")
        return len(answers) >= 8 and all(b"synced" in a for a in answers[-8:])

    try:
        polling.eventually(synced, "the view synced on 8 readiness checks in a row", timeout=30, interval=0.05,
                           gone=server.exited)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {answers[-3:]}\n{server.output()}") from None


def test_serve_chooses_over_the_live_view(fake, certs_dir, tmp_path, monkeypatch):
    fake.put("nodes", o.node("gpu-a", {0: 100, 1: 100}))
    fake.put("pods", o.pod("big", 0, 70, "gpu-a"))
    server = _serve(fake, certs_dir, tmp_path, monkeypatch)
    try:
        _wait_synced(server)
        # One view per replica: the nodes and the pods are each listed once, and watched by one thread.
        lists = [p for m, p, _ in fake.requests if m == "GET" and "watch" not in p]
        assert len([p for p in lists if p.startswith("/api/v1/nodes")]) == 1, lists
        assert len([p for p in lists if p.startswith("/api/v1/pods")]) == 1, lists
        assert "collide" not in server.output()

        # Card 0 has 30 free: binpack puts the first quarter there; every later review, whichever
        # connection and thread it comes on, sees that choice and goes to card 1.
        assert [card for card, _ in _cards(server, "0.25", 4)] == [0, 1, 1, 1]

        # Card 1 fills up (on the API, not through the webhook); a new node's empty card 0 is next.
        fake.put("pods", o.pod("other", 1, 100, "gpu-a"))
        fake.put("nodes", o.node("gpu-b", {0: 100}))
        o.wait_for(lambda: _cards(server, "0.25", 1)[0][0] == 0, timeout=15, what="the view to see gpu-b")
        for card, warnings in _cards(server, "0.25", 2):
            assert card == 0 and warnings == []
    finally:
        server.stop()


def test_several_workers_each_try_their_part_of_the_cards(fake, certs_dir, tmp_path, monkeypatch):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    server = _serve(fake, certs_dir, tmp_path, monkeypatch, "--workers", "2")
    try:
        _wait_synced(server)
        o.wait_for(lambda: all(f"worker {j} of 2 of this replica" in server.output() for j in (0, 1)),
                   timeout=15, what="each worker's part")
    finally:
        server.stop()


def _answer(server, pod: dict) -> dict:
    review = objects.review(pod)
    status, _, body = server.request("POST", "/mutate", json.dumps(review).encode())
    assert status == 200
    return objects.response_of(json.loads(body), review["request"]["uid"])


def test_serve_judges_pods_by_the_live_device_classes(fake, certs_dir, tmp_path, monkeypatch):
    fake.put("nodes", o.node("gpu-a", {0: 100}))
    fake.put("deviceclasses", {"metadata": {"name": "gpu.example.com"},
                               "spec": {"extendedResourceName": "gpushard.io/gpu"}})
    server = _serve(fake, certs_dir, tmp_path, monkeypatch)
    try:
        _wait_synced(server)
        pod = objects.pod(objects.container("train", "0.25"))
        o.wait_for(lambda: _answer(server, pod)["allowed"] is False, timeout=15, what="the class to be seen")
        assert "DeviceClass gpu.example.com has spec.extendedResourceName gpushard.io/gpu" in \
            _answer(server, pod)["status"]["message"]
        lists = [p for m, p, _ in fake.requests if m == "GET" and "watch" not in p]
        assert len([p for p in lists if p.startswith("/apis/resource.k8s.io/v1/deviceclasses")]) == 1, lists

        fake.put("deviceclasses", {"metadata": {"name": "gpu.example.com"},
                                   "spec": {"extendedResourceName": "nvidia.com/gpu"}})
        o.wait_for(lambda: _answer(server, pod)["allowed"] is True, timeout=15, what="the changed class")
        assert any("DeviceClass gpu.example.com serves nvidia.com/gpu too" in w
                   for w in _answer(server, pod).get("warnings", []))
    finally:
        server.stop()
