"""Golden manifests per rule, read by both front doors: admission (decisions.decide) and `gpushard audit -f`.

We test:
- every rule id of a single object (webhook/core/findings.py) and every audit rule has a
  `<rule>.fail.yaml` and a `<rule>.pass.yaml` in tests/golden/, and nothing else lives there; the
  DeviceClasses among a manifest's documents are what admission knows of the cluster's classes;
- admission, for each fail manifest, with the verdict and words its rule's entry in EXPECT
  gives: every object is denied in enforce mode (403, or 400 for what cannot be read) with a
  message holding the key words, and admitted in audit mode with each finding of the rule
  among its warnings; or, for what enforce mode rewrites away, admitted in enforce mode as
  exactly the object of `<rule>.patched.yaml` (and its JSONPatch, when one is recorded, makes
  that object), with the rule gone from it, while audit mode warns with the key words; each
  pass manifest gets no finding of its rule in either mode. The host-path fail manifest
  names one finding per hostPath volume, each naming its volume;
- audit: `gpushard audit -f` reports exactly the fail manifest's rule (exit 1), and nothing at
  all for the pass manifest (exit 0), in the table and in JSON;
- what the audit rules find gets past admission: decide allows every object of their fail
  manifests in both modes and denies none of it, so only the audit shows it.
"""

from __future__ import annotations

import json
import pathlib

import jsonpatch
import pytest
import yaml

from webhook import cli, settings
from webhook.admission import patches
from webhook.core import auditing, decisions, extended, names
from webhook.core import findings as f

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"

# Rules about card choice over a view of the cluster: no single manifest passes or fails them.
PLACEMENT_RULES = {f.NO_ROOM, f.NO_VIEW, f.NO_MATCHING_NODE, f.MEMORY_ABOVE_CARD, f.MEMORY_SIZED}
ADMISSION_RULES = sorted(
    value for key, value in vars(f).items()
    if key.isupper() and isinstance(value, str) and key not in ("DENY", "WARN", "CHANGE", "NOTE") and value not in
    PLACEMENT_RULES)
AUDIT_RULES = sorted(auditing.RULES)


def golden(rule: str, verdict: str) -> pathlib.Path:
    return GOLDEN / f"{rule}.{verdict}.yaml"


def config_args(rule: str) -> list[str]:
    config = GOLDEN / f"{rule}.config.yaml"
    return ["--config", str(config)] if config.exists() else []


def policy_for(rule: str):
    config = GOLDEN / f"{rule}.config.yaml"
    return settings.load(config if config.exists() else None).policy


def admitted_kinds(path: pathlib.Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d for d in docs if d.get("kind") == names.POD_KIND or d.get("kind") in names.TEMPLATE_PATHS]


def served_in(path: pathlib.Path):
    """The extended resources the DeviceClasses among a manifest's documents serve (as the webhook's view of them)."""
    return extended.served_by(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == extended.KIND)


def rules_of(decision: decisions.Decision) -> set[str]:
    return {x.rule for x in decision.findings}


def decide(obj: dict, mode: str, policy, served=extended.NONE) -> decisions.Decision:
    return decisions.decide(decisions.Request(obj, obj["kind"], "CREATE", mode, served=served), policy, None)


def test_every_rule_has_a_pass_and_a_fail_manifest():
    expected = {golden(r, v).name for r in ADMISSION_RULES + AUDIT_RULES for v in ("pass", "fail")}
    present = {p.name for p in GOLDEN.glob("*.yaml") if not p.name.endswith((".config.yaml", ".patched.yaml"))}
    assert present == expected


def test_audit_rules_are_new_ids():
    assert not set(AUDIT_RULES) & set(ADMISSION_RULES)
    assert all(auditing.fix_for(rule) for rule in AUDIT_RULES + ADMISSION_RULES)


DENIED, REWRITTEN = "denied", "rewritten"
# Each admission rule's verdict on its fail manifest in enforce mode, and words its messages must
# hold (audit mode admits with warnings either way).
EXPECT = {
    f.ADDED_CAPABILITIES: (DENIED, ['"tools"', "NET_ADMIN", "SYS_ADMIN", "beyond Pod Security's baseline"]),
    f.BAD_CARD: (DENIED, ["'gpushard.io/card-01'", "no card resource"]),
    f.BAD_QUANTITY: (DENIED, ["'half'", "not a quantity"]),
    f.BAD_SHARES: (DENIED, ["gpushard.io/gpu 150", "whole number from 1 to 100"]),
    f.BOTH_FORMS: (DENIED, ["nvidia.com/gpu 0.5", "gpushard.io/gpu 50", "use one"]),
    f.CONFLICTING_PINS: (DENIED, ["cards 0, 1", "share one card"]),
    f.DEVICE_ANNOTATION: (DENIED, ['"devices.noderesource.dev/container.app"', '"mounts.nri.io/pod"', "inject devices",
                              "inject mounts", "whatever its value"]),
    f.DEVICE_LIST_MOUNT: (DENIED, ['"scratch"', "/var/run/nvidia-container-devices/all", "device-list folder"]),
    f.EXTENDED_RESOURCE_SHARED: (REWRITTEN, ["DeviceClass gpu.nvidia.com serves nvidia.com/gpu too",
                                             "become gpushard.io/gpu shares"]),
    f.EXTENDED_RESOURCE_TAKEN: (DENIED, ["DeviceClass gpu.example.com", "spec.extendedResourceName gpushard.io/gpu",
                                         "driver gpu.example.com", "remove extendedResourceName from that class",
                                         "other resource names in its config"]),
    f.FRACTION_ABOVE_ONE: (DENIED, ["nvidia.com/gpu 1.5", "at most one card"]),
    f.FRACTION_UNREWRITTEN: (REWRITTEN, ["nvidia.com/gpu 0.25", "rejects fractions"]),
    f.HOST_PATH: (DENIED, ["is hostPath /dev ", "is hostPath / ", "device files", "kubelet's folders",
                           "a folder holding /dev", "processes and kernel controls", "the container runtime",
                           "hostPath /var/log ", "only host paths the operator allows"]),
    f.HOST_PID: (DENIED, ["spec.hostPID", "process namespace"]),
    f.LIMIT_ENV_FROM: (DENIED, ['configMap "settings" with no prefix', 'secret "tokens" with prefix "CUDA_"']),
    f.LIMIT_ENV_SET: (REWRITTEN, ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, NVIDIA_GPU_MEMORY_LIMIT", "remove"]),
    f.MIXED_MEMORY: (DENIED, ["gpushard.io/memory 12Gi", "asks a share of a card", "not both"]),
    f.MIXED_PASSTHROUGH: (DENIED, ['"whole" passes whole cards', '"part" holds shares']),
    f.MULTI_CARD: (DENIED, ["nvidia.com/gpu 2", "at most one card"]),
    f.PIN_MISMATCH: (DENIED, ["30 shares", "gpushard.io/card-2 40"]),
    f.POD_OVER_CARD: (DENIED, ["120 shares", "a card has 100"]),
    f.PRIVILEGED: (DENIED, ['init container "setup" is privileged', "every card"]),
    f.REQUESTS_DIFFER: (DENIED, ["0.25 in requests", "0.5 in limits"]),
    f.ROUNDED: (REWRITTEN, ["nvidia.com/gpu 0.333", "rounded up to 34 of 100 shares"]),
    f.UNHIDDEN: (REWRITTEN, ['"logger" asks no GPU', "every card"]),
    f.UNREADABLE: (DENIED, ["cannot read spec.containers", "expected a list"]),
    f.VISIBLE_DEVICES_FROM: (DENIED, ['configMap "settings"', "envFrom", "NVIDIA_VISIBLE_DEVICES"]),
    f.VISIBLE_DEVICES_SET: (REWRITTEN, ["NVIDIA_VISIBLE_DEVICES=all"]),
}


def test_every_admission_rule_has_its_expectations():
    assert set(EXPECT) == set(ADMISSION_RULES)
    rewritten = {rule for rule, (verdict, _) in EXPECT.items() if verdict == REWRITTEN}
    assert {p.name for p in GOLDEN.glob("*.patched.yaml")} == {golden(r, "patched").name for r in rewritten}


def of_rule(decision: decisions.Decision, rule: str) -> list[f.Finding]:
    return [x for x in decision.findings if x.rule == rule]


@pytest.mark.parametrize("rule", ADMISSION_RULES)
def test_admission_fails_the_fail_manifest(rule):
    """Breaks this catches, each tried on a copy and caught: shares rounded down (33, "rounded
    down"), every pod pinned to card 0 (the rounded manifest's second pod pins card 1),
    host-access denials turned into warnings (enforce admits), a denial's message without its
    container or value, an env rewrite that keeps NVIDIA_VISIBLE_DEVICES=all."""
    policy = policy_for(rule)
    verdict, words = EXPECT[rule]
    objects = admitted_kinds(golden(rule, "fail"))
    served = served_in(golden(rule, "fail"))
    assert objects
    patched = admitted_kinds(golden(rule, "patched")) if verdict == REWRITTEN else []
    assert len(patched) == (len(objects) if verdict == REWRITTEN else 0)
    messages = []
    for i, obj in enumerate(objects):
        enforced = decide(obj, names.MODE_ENFORCE, policy, served)
        audited = decide(obj, names.MODE_AUDIT, policy, served)
        found = of_rule(audited, rule)
        assert found, f"object {i} of {golden(rule, 'fail').name} breaks no {rule} in audit mode"
        # Audit mode admits, the rule's findings among its warnings.
        assert audited.allowed and audited.obj is None
        assert set(decisions.warnings_for(found)) <= set(audited.warnings)
        messages += [x.message for x in found]
        if verdict == DENIED:
            assert not enforced.allowed and enforced.code == (400 if rule == f.UNREADABLE else 403)
            assert {x.severity for x in of_rule(enforced, rule)} == {f.DENY}
            assert enforced.message.startswith("gpushard: ")
            assert all(x.message.removeprefix("gpushard: ") in enforced.message for x in of_rule(enforced, rule))
        else:
            assert enforced.allowed and enforced.code == 200
            assert f.DENY not in {x.severity for x in of_rule(enforced, rule)}
            assert enforced.obj == patched[i], f"object {i}: enforce admits another object than the patched golden"
            assert jsonpatch.apply_patch(obj, patches.make(obj, enforced.obj)) == patched[i]
            assert not of_rule(decide(enforced.obj, names.MODE_AUDIT, policy, served), rule)
    text = "\n".join(messages)
    missing = [w for w in words if w not in text]
    assert not missing, f"{rule}: the messages lack {missing}:\n{text}"


def test_every_host_path_of_the_fail_manifest_is_named():
    (job,) = admitted_kinds(golden(f.HOST_PATH, "fail"))
    volumes = job["spec"]["template"]["spec"]["volumes"]
    assert len(volumes) >= 10
    for mode in names.MODES:
        found = of_rule(decide(job, mode, policy_for(f.HOST_PATH)), f.HOST_PATH)
        assert [x.message.split('"')[1] for x in found] == [v["name"] for v in volumes]


@pytest.mark.parametrize("rule", ADMISSION_RULES)
def test_admission_passes_the_pass_manifest(rule):
    policy = policy_for(rule)
    objects = admitted_kinds(golden(rule, "pass"))
    assert objects
    for obj in objects:
        for mode in names.MODES:
            decision = decide(obj, mode, policy, served_in(golden(rule, "pass")))
            assert decision.allowed
            assert rule not in rules_of(decision)


@pytest.mark.parametrize("rule", AUDIT_RULES)
def test_admission_lets_through_what_only_the_audit_sees(rule):
    # A rule about a Namespace or a Node has no object here: admission never sees those at all.
    for obj in admitted_kinds(golden(rule, "fail")):
        for mode in names.MODES:
            decision = decide(obj, mode, policy_for(rule), served_in(golden(rule, "fail")))
            assert decision.allowed
            assert not [x for x in decision.findings if x.severity == f.DENY]


def run_audit_json(rule: str, verdict: str, capsys) -> tuple[int, dict]:
    code = cli.main(["audit", "-f", str(golden(rule, verdict)), "-o", "json", *config_args(rule)])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("rule", ADMISSION_RULES + AUDIT_RULES)
def test_audit_reports_the_fail_manifest(rule, capsys):
    code, report = run_audit_json(rule, "fail", capsys)
    assert code == 1
    assert {x["rule"] for x in report["findings"]} == {rule}
    for finding in report["findings"]:
        assert finding["fix"] == auditing.fix_for(rule)
        assert finding["source"].startswith(str(golden(rule, "fail")) + "#")
        assert finding["message"].startswith("gpushard: ")


@pytest.mark.parametrize("rule", ADMISSION_RULES + AUDIT_RULES)
def test_audit_passes_the_pass_manifest(rule, capsys):
    code, report = run_audit_json(rule, "pass", capsys)
    assert (code, report["findings"]) == (0, [])
    assert report["summary"]["objects"] >= 1


@pytest.mark.parametrize("rule", ADMISSION_RULES + AUDIT_RULES)
def test_audit_table_names_rule_and_fix(rule, capsys):
    code = cli.main(["audit", "-f", str(golden(rule, "fail")), *config_args(rule)])
    table = capsys.readouterr().out
    assert code == 1
    assert f" {rule}" in table
    assert "fix: " in table
    assert max(len(line) for line in table.splitlines()) <= 120
