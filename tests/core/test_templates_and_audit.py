"""We test:
- every pod-template kind on CREATE and UPDATE: fractions become integer shares, no card, no env;
- templates are denied for the same reasons pods are, and a rewritten template is idempotent;
- audit mode: the same evaluation, no patch, findings as short warnings and audit annotations;
- the API server's limits on warnings (120 characters each, 4096 in all) and annotation keys.
"""

import copy

import pytest

from tests import applypatch
from tests.core import podmaker as pm
from webhook.core import decisions, findings, names, placement, policy

POLICY = policy.Policy()
VIEW = placement.View(nodes=(placement.Node("n", cards=(placement.Card(0, 100, 0),)),))


def workload(kind: str, *containers: dict) -> dict:
    template = {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": list(containers)}}
    api = {"Job": "batch/v1", "CronJob": "batch/v1", "ReplicationController": "v1", "PodTemplate": "v1"}
    obj = {"apiVersion": api.get(kind, "apps/v1"), "kind": kind, "metadata": {"name": "w", "namespace": "t"}}
    if kind == "PodTemplate":
        obj["template"] = template
    elif kind == "CronJob":
        template["spec"]["restartPolicy"] = "OnFailure"
        obj["spec"] = {"schedule": "*/5 * * * *", "jobTemplate": {"spec": {"template": template}}}
    elif kind == "Job":
        template["spec"]["restartPolicy"] = "Never"
        obj["spec"] = {"template": template}
    elif kind == "ReplicationController":
        obj["spec"] = {"selector": {"app": "x"}, "template": template}
    else:
        obj["spec"] = {"selector": {"matchLabels": {"app": "x"}}, "template": template}
        if kind == "StatefulSet":
            obj["spec"]["serviceName"] = "w"
    return obj


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
@pytest.mark.parametrize("kind", sorted(names.TEMPLATE_PATHS))
def test_template_fractions_become_integer_shares(kind, operation):
    obj = workload(kind, pm.container("train", "0.25"), pm.container("tools"), pm.container("cpu", "0"))
    with pytest.raises(applypatch.Rejected):
        applypatch.validate(obj)  # what happens without gpushard
    d = decisions.decide(decisions.Request(obj, kind, operation=operation), POLICY, VIEW)
    assert d.allowed
    new = applypatch.admit(obj, applypatch.make_patch(obj, d.obj))
    spec = applypatch.pod_spec(new)
    train, tools, cpu = spec["containers"]
    assert train["resources"]["limits"]["gpushard.io/gpu"] == train["resources"]["requests"]["gpushard.io/gpu"] == "25"
    assert "nvidia.com/gpu" not in train["resources"]["limits"]
    assert not any(k.startswith("gpushard.io/card-") for k in train["resources"]["limits"])
    assert "env" not in train and "env" not in tools, "env is added per pod, not in templates"
    assert cpu == obj_spec_container(obj, 2)
    again = decisions.decide(decisions.Request(new, kind, operation=operation), POLICY, VIEW)
    assert applypatch.make_patch(new, again.obj) == []


@pytest.mark.parametrize("kind", sorted(names.TEMPLATE_PATHS))
def test_whole_cards_stay_as_written_in_templates(kind):
    # An integer nvidia.com/gpu is valid in a template; each pod gets it as shares when created.
    obj = workload(kind, pm.container("whole", "1"))
    d = decisions.decide(decisions.Request(obj, kind), POLICY, VIEW)
    assert d.allowed and applypatch.make_patch(obj, d.obj) == []


def obj_spec_container(obj, i):
    return applypatch.pod_spec(obj)["containers"][i]


@pytest.mark.parametrize("kind", sorted(names.TEMPLATE_PATHS))
def test_templates_are_denied_like_pods(kind):
    d = decisions.decide(decisions.Request(workload(kind, pm.container("train", "1.5")), kind), POLICY, VIEW)
    assert not d.allowed and d.code == 403 and "nvidia.com/gpu 1.5" in d.message


def test_pod_created_from_a_rewritten_template_gets_its_card():
    dep = pm.deployment(pm.container("train", "0.5"))
    d = decisions.decide(decisions.Request(dep, "Deployment"), POLICY, VIEW)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "d-1", "namespace": "team-a"},
           "spec": copy.deepcopy(d.obj["spec"]["template"]["spec"])}
    p = decisions.decide(decisions.Request(pod, "Pod"), POLICY, VIEW)
    new = applypatch.admit(pod, applypatch.make_patch(pod, p.obj))
    assert p.card == 0 and new["spec"]["containers"][0]["resources"]["limits"]["gpushard.io/card-0"] == "50"


def test_audit_changes_nothing_and_reports_everything():
    obj = pm.pod(pm.container("train", "0.333", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
                 pm.container("tools"))
    d = decisions.decide(decisions.Request(obj, "Pod", mode="audit"), POLICY, VIEW)
    assert d.allowed and d.obj is None
    rules = {f.rule for f in d.findings}
    assert rules == {findings.ROUNDED, findings.VISIBLE_DEVICES_SET, findings.FRACTION_UNREWRITTEN,
                     findings.UNHIDDEN}
    assert set(d.audit_annotations) == rules
    assert all(w.startswith("gpushard: ") and len(w) <= 120 for w in d.warnings)


def test_audit_reports_denials_without_denying():
    d = decisions.decide(decisions.Request(pm.pod(pm.container("train", "3")), "Pod", mode="audit"), POLICY, VIEW)
    assert d.allowed and d.obj is None
    assert d.audit_annotations == {"multi-card": d.findings[0].message}
    d = decisions.decide(decisions.Request({"kind": "Pod", "spec": {"containers": 5}}, "Pod", mode="audit"),
                         POLICY, VIEW)
    assert d.allowed and [f.rule for f in d.findings] == ["unreadable"]


def test_warnings_stay_within_the_api_servers_limits():
    many = [pm.container("c" * 60 + str(i), "0.333") for i in range(80)]
    d = decisions.decide(decisions.Request(pm.pod(*many), "Pod", mode="audit"), POLICY, VIEW)
    assert all(len(w) <= 120 for w in d.warnings)
    assert sum(len(w) for w in d.warnings) <= 4096
    assert "left out" in d.warnings[-1]
    assert all(len(k) <= 63 and "/" not in k for k in d.audit_annotations)


def test_updates_that_leave_the_template_alone_pass_for_old_violators():
    # A workload from before the namespace opted in: labels, scaling and deletion must still work.
    old = workload("Deployment", pm.container("train", "2"))
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"team": "x"}
    d = decisions.decide(decisions.Request(new, "Deployment", operation="UPDATE", old=old), POLICY, VIEW)
    assert d.allowed and applypatch.make_patch(new, d.obj) == []
    deleting = copy.deepcopy(new)
    deleting["metadata"]["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    deleting["spec"]["template"]["spec"]["containers"][0]["image"] = "other"
    d = decisions.decide(decisions.Request(deleting, "Deployment", operation="UPDATE", old=old), POLICY, VIEW)
    assert d.allowed
    # Changing the template is judged like a new one.
    changed = copy.deepcopy(new)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "other"
    d = decisions.decide(decisions.Request(changed, "Deployment", operation="UPDATE", old=old), POLICY, VIEW)
    assert not d.allowed and "nvidia.com/gpu 2" in d.message


def test_template_keeps_an_explicit_pin():
    c = pm.container("train", "500m", extra={"gpushard.io/card-1": "50"})
    obj = workload("Deployment", c)
    d = decisions.decide(decisions.Request(obj, "Deployment"), POLICY, VIEW)
    new = applypatch.admit(obj, applypatch.make_patch(obj, d.obj))
    limits = applypatch.pod_spec(new)["containers"][0]["resources"]["limits"]
    assert limits["gpushard.io/gpu"] == limits["gpushard.io/card-1"] == "50" and "nvidia.com/gpu" not in limits
