"""We test what the app does with the review fields beyond the object:
- a reinvocation over a pod gpushard already placed (another webhook added a container) keeps its card
  and is not counted on the view a second time;
- an UPDATE whose oldObject has the same template passes even for a workload that breaks the rules;
- a pods/ephemeralcontainers UPDATE hides the node's cards from the debug container.
"""

from __future__ import annotations

import copy

from tests.admission import objects
from tests.admission.test_app import post


def _used(view) -> int:
    return sum(c.used for n in view.snapshot().nodes for c in n.cards)


def test_reinvocation_is_not_counted_twice(client, view):
    pod = objects.pod(objects.container("t", "0.3"))
    first = objects.patched(pod, post(client, "/mutate", objects.review(pod)))
    after_first = _used(view)
    first["spec"]["containers"].append(objects.container("istio-proxy"))
    response = post(client, "/mutate", objects.review(first))
    again = objects.patched(first, response)
    assert again["metadata"]["annotations"] == first["metadata"]["annotations"]
    assert again["spec"]["containers"][1]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert _used(view) == after_first
    assert not response.get("warnings")


def test_updates_judge_the_template_against_the_old_object(client):
    old = objects.deployment(objects.container("train", "2"))
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"owner": "ml"}
    review = objects.review(new, operation="UPDATE")
    review["request"]["oldObject"] = old
    assert post(client, "/mutate", review)["allowed"] is True
    review = objects.review(new, operation="UPDATE")
    assert post(client, "/mutate", review)["allowed"] is False, "without oldObject the template is judged"


def test_ephemeral_containers_are_hidden(client):
    pod = objects.pod(objects.container("t", "0.5"))
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "cuda"}]
    review = objects.review(pod, operation="UPDATE")
    review["request"]["subResource"] = "ephemeralcontainers"
    new = objects.patched(pod, post(client, "/mutate", review))
    assert new["spec"]["ephemeralContainers"][0]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert new["spec"]["containers"] == pod["spec"]["containers"]
