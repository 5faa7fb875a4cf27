"""We test, on the real kube-apiserver with deploy/base and a healthy webhook, pods in an enforce namespace whose
shape, not their content, once let them skip the hiding. Each is sent as raw JSON (`kubectl create --raw`, a
server-side dry run: admission runs, nothing is stored), and each is hidden from the cards or refused, never
admitted with its image's NVIDIA_VISIBLE_DEVICES:
- a container command of 1.42 MB of '<' (the API server escapes each as six bytes in the review: over 8 MiB):
  hidden;
- metadata.managedFields nested 1,200 and 5,000 levels deep (deeper than Python's parser goes; the API server
  drops these fields only when it stores the pod): refused by the hide entry, gpushard's message naming where;
- 2,000 to 150,000 annotations: the enforce condition's cost grows with them, past the API server's limit (it
  errs, and failurePolicy Fail refuses), while the hide condition's does not: each pod is hidden or refused
  (by gpushard's entry, or by the API server's validation after the hiding), and the largest is refused by the
  enforce entry;
- while 64 connections to the webhook's port stall mid-handshake and mid-request and are opened again as
  soon as the webhook closes them (8 threads), every pod created through the API server is answered and
  hidden.
"""

from __future__ import annotations

import json
import ssl

import pytest

from tests import stalling
from tests.e2e import objects


def create_raw(kubectl, namespace: str, body: bytes, tmp_path) -> tuple[dict | None, str]:
    """The pod as admission leaves it, or None and what kubectl printed when the API server refused it."""
    path = tmp_path / "pod.json"
    path.write_bytes(body)
    done = kubectl.run("create", "--raw", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", "-f", str(path),
                       check=False, timeout=180)
    if done.returncode == 0:
        return json.loads(done.stdout), ""
    return None, done.stdout + done.stderr


def hidden(pod: dict) -> bool:
    return all(objects.env_of(c).get("NVIDIA_VISIBLE_DEVICES") == "void" for c in pod["spec"]["containers"])


def plain(name: str, **container: object) -> dict:
    """A pod that asks no GPU; its image's NVIDIA_VISIBLE_DEVICES (every CUDA image says all) is not in its spec."""
    return json.loads(objects.pod(name, {**objects.container(), **container}))


def test_a_review_over_8_mib_is_hidden(installed, kubectl, namespace, tmp_path):
    pod = plain("lt", lifecycle={"preStop": {"exec": {"command": ["<" * 1_420_000]}}})
    created, said = create_raw(kubectl, namespace, json.dumps(pod).encode(), tmp_path)
    assert created is not None, said[-2000:]
    assert hidden(created), [objects.env_of(c) for c in created["spec"]["containers"]]


@pytest.mark.parametrize("levels", [1200, 5000])
def test_managed_fields_too_deep_to_parse_are_refused_with_where(installed, kubectl, namespace, tmp_path, levels):
    pod = plain("deep")
    pod["metadata"]["managedFields"] = [{"manager": "m", "operation": "Update", "apiVersion": "v1",
                                         "fieldsType": "FieldsV1", "fieldsV1": "DEEP"}]
    body = json.dumps(pod).encode().replace(b'"DEEP"', b'{"f:a":' * levels + b"{}" + b"}" * levels)
    created, said = create_raw(kubectl, namespace, body, tmp_path)
    assert created is None, [objects.env_of(c) for c in created["spec"]["containers"]]
    assert 'admission webhook "hide.gpushard.io" denied the request' in said, said[-2000:]
    assert "gpushard: cannot read this object: over 500 levels deep at metadata.managedFields[0].fieldsV1" in said


def test_no_number_of_annotations_skips_the_hiding(installed, kubectl, namespace, tmp_path):
    outcomes = {}
    for count in (2000, 30000, 60000, 150000):
        pod = plain(f"many-{count}")
        pod["metadata"]["annotations"] = {f"e.io/a{i}": "x" for i in range(count)}
        created, said = create_raw(kubectl, namespace, json.dumps(pod).encode(), tmp_path)
        if created is not None:
            outcomes[count] = "hidden" if hidden(created) else "admitted unhidden"
        elif "cost limit exceeded" in said and "capabilities.add.exists" in said:
            # The condition that erred is the enforce entry's (the hide entry's reads no capabilities).
            outcomes[count] = "refused by the enforce entry"
        elif "metadata.annotations: Too long" in said:
            outcomes[count] = "refused by validation"
        else:
            outcomes[count] = f"refused: {said[-300:]}"
    assert outcomes[2000] == "hidden" and outcomes[150000] == "refused by the enforce entry", outcomes
    assert "admitted unhidden" not in outcomes.values(), outcomes


def test_stalled_clients_hold_no_review(installed, kubectl, namespace):
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    ended = stalling.attack(installed.port, context, 64)
    outcomes = []
    try:
        for i in range(20):
            done = kubectl.run("create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-",
                               input=objects.pod(f"during-{i}", objects.container()), check=False)
            outcomes.append("hidden" if done.returncode == 0 and hidden(json.loads(done.stdout))
                            else f"failed: {done.stderr.strip()[-300:]}")
    finally:
        ended()
    assert outcomes == ["hidden"] * 20, outcomes
