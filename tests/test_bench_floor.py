"""bench/floor.py: the floor it measures gpushard against is what it says: over real TLS, the no-op webhook
allows and changes nothing, and the patching one adds an env var and an annotation to any pod; and its
summary reads a run's rows back."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import sys
import threading
from pathlib import Path

import jsonpatch
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import floor  # noqa: E402

from webhook import certificates  # noqa: E402


@pytest.fixture(scope="module")
def trivial(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trivial")
    ca_key, ca_cert = certificates.make_ca()
    key, cert = certificates.make_serving(ca_key, ca_cert, ["localhost"])
    (folder / "ca.crt").write_bytes(certificates.cert_pem(ca_cert))
    (folder / "tls.crt").write_bytes(certificates.cert_pem(cert))
    (folder / "tls.key").write_bytes(certificates.key_pem(key))
    server = floor.trivial_server(0, str(folder / "tls.crt"), str(folder / "tls.key"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))

    def review(path: str, pod: dict) -> dict:
        connection = http.client.HTTPSConnection("localhost", server.server_address[1], context=context, timeout=5)
        connection.request("POST", path, json.dumps({"request": {"uid": "u-1", "object": pod}}),
                           {"Content-Type": "application/json"})
        answer = connection.getresponse()
        assert answer.status == 200
        return json.loads(answer.read())["response"]
    yield review
    server.shutdown()


def patched(pod: dict, response: dict) -> dict:
    assert response["patchType"] == "JSONPatch"
    return jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))


def test_the_noop_webhook_allows_and_changes_nothing(trivial):
    response = trivial("/noop?timeout=5s", floor.gpu_pod(1, "none"))
    assert response == {"uid": "u-1", "allowed": True}


@pytest.mark.parametrize("annotated", [False, True])
@pytest.mark.parametrize("with_env", [False, True])
def test_the_patching_webhook_adds_an_env_var_and_an_annotation(trivial, annotated, with_env):
    pod = floor.gpu_pod(2, "none")
    if annotated:
        pod["metadata"]["annotations"] = {"team": "vision"}
    if not with_env:
        del pod["spec"]["containers"][0]["env"]
    response = trivial("/patch?timeout=5s", pod)
    assert response["allowed"] is True
    out = patched(pod, response)
    assert out["spec"]["containers"][0]["env"][-1] == {"name": "BENCH", "value": "patched"}
    assert out["metadata"]["annotations"]["bench.gpushard.io/patched"] == "yes"
    assert len(out["spec"]["containers"][0]["env"]) == (2 if with_env else 1)
    assert out["metadata"]["annotations"].get("team") == ("vision" if annotated else None)


def test_gpu_pods_ask_replicas_without_gpushard_and_a_fraction_with_it():
    assert floor.gpu_pod(0, "patching")["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "25"
    assert floor.gpu_pod(0, "gpushard")["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "0.25"


def row(workload: str, setup: str, apiserver: float, scheduler: float, webhook: float = 0.0, calls: float = 0.0) -> str:
    return json.dumps({"round": 0, "workload": workload, "setup": setup, "refused": 0,
                       "cpu_ms": {"kube-apiserver": apiserver, "kube-scheduler": scheduler, "webhook": webhook},
                       "p50_ms": 8.0, "p99_ms": 20.0, "matching": {"enforce.gpushard.io calls": calls}})


def test_the_summary_compares_gpu_pods_with_the_patching_webhook_and_plain_pods_with_none(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("\n".join([
        "started", row(floor.GPU, "patching", 10.0, 4.0, 0.6, 1.0), row(floor.GPU, "gpushard", 12.0, 4.0, 3.0, 1.0),
        row(floor.OUTSIDE, "none", 8.0, 4.0), row(floor.OUTSIDE, "gpushard", 8.4, 4.0)]))
    lines = floor.from_log(log)
    gpushard, = [line for line in lines if line.startswith("GPU pods | gpushard")]
    assert gpushard.split(" | ")[2:7] == ["12.00", "1.200 (1.200-1.200)", "3.00", "1.200 (1.200-1.200)", "3.00"]
    outside, = [line for line in lines if line.startswith("plain pods outside | gpushard")]
    assert outside.split(" | ")[3] == "1.050 (1.050-1.050)"


def test_a_log_without_rows_is_named(tmp_path):
    log = tmp_path / "empty.log"
    log.write_text("nothing here\n")
    with pytest.raises(ValueError, match="no rows of bench/floor.py"):
        floor.from_log(log)
