"""Golden manifests per rule, read by both front doors: admission (decisions.decide) and `gpushard audit -f`.

We test:
- every rule id of a single object (webhook/core/findings.py) and every audit rule has a
  `<rule>.fail.yaml` and a `<rule>.pass.yaml` in tests/golden/, and nothing else lives there;
- admission: each fail manifest is denied or warned with its rule in enforce mode, or, for what
  enforce mode rewrites away, found in audit mode and gone from the object enforce mode admits;
  each pass manifest gets no finding of its rule in either mode;
- audit: `gpushard audit -f` reports exactly the fail manifest's rule (exit 1), and nothing at
  all for the pass manifest (exit 0), in the table and in JSON;
- what the audit rules find gets past admission: decide allows every object of their fail
  manifests in both modes and denies none of it, so only the audit shows it.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from webhook import cli, settings
from webhook.core import audit, decisions, names
from webhook.core import findings as f

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"

# Rules about card choice over a view of the cluster: no single manifest passes or fails them.
PLACEMENT_RULES = {f.NO_ROOM, f.NO_VIEW, f.NO_MATCHING_NODE, f.MEMORY_ABOVE_CARD, f.MEMORY_SIZED}
ADMISSION_RULES = sorted(
    value for key, value in vars(f).items()
    if key.isupper() and isinstance(value, str) and key not in ("DENY", "WARN", "CHANGE") and value not in
    PLACEMENT_RULES)
AUDIT_RULES = sorted(audit.RULES)


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


def rules_of(decision: decisions.Decision) -> set[str]:
    return {x.rule for x in decision.findings}


def decide(obj: dict, mode: str, policy) -> decisions.Decision:
    return decisions.decide(decisions.Request(obj, obj["kind"], "CREATE", mode), policy, None)


def test_every_rule_has_a_pass_and_a_fail_manifest():
    expected = {golden(r, v).name for r in ADMISSION_RULES + AUDIT_RULES for v in ("pass", "fail")}
    present = {p.name for p in GOLDEN.glob("*.yaml") if not p.name.endswith(".config.yaml")}
    assert present == expected


def test_audit_rules_are_new_ids():
    assert not set(AUDIT_RULES) & set(ADMISSION_RULES)
    assert all(audit.fix_for(rule) for rule in AUDIT_RULES + ADMISSION_RULES)


@pytest.mark.parametrize("rule", ADMISSION_RULES)
def test_admission_fails_the_fail_manifest(rule):
    policy = policy_for(rule)
    objects = admitted_kinds(golden(rule, "fail"))
    assert objects
    seen = []
    for obj in objects:
        enforced = decide(obj, names.MODE_ENFORCE, policy)
        if rule in rules_of(enforced):
            seen.append(obj)
            continue
        # What enforce mode rewrites away shows only in audit mode, and must be gone once rewritten.
        if rule in rules_of(decide(obj, names.MODE_AUDIT, policy)):
            assert enforced.allowed and enforced.obj is not None
            assert rule not in rules_of(decide(enforced.obj, names.MODE_AUDIT, policy))
            seen.append(obj)
    assert seen, f"no object of {golden(rule, 'fail').name} was found to break {rule}"


@pytest.mark.parametrize("rule", ADMISSION_RULES)
def test_admission_passes_the_pass_manifest(rule):
    policy = policy_for(rule)
    objects = admitted_kinds(golden(rule, "pass"))
    assert objects
    for obj in objects:
        for mode in names.MODES:
            decision = decide(obj, mode, policy)
            assert decision.allowed
            assert rule not in rules_of(decision)


@pytest.mark.parametrize("rule", AUDIT_RULES)
def test_admission_lets_through_what_only_the_audit_sees(rule):
    # A rule about a Namespace or a Node has no object here: admission never sees those at all.
    for obj in admitted_kinds(golden(rule, "fail")):
        for mode in names.MODES:
            decision = decide(obj, mode, policy_for(rule))
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
        assert finding["fix"] == audit.fix_for(rule)
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
