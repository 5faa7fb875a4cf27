"""charts/gpushard/values.schema.json refuses what gpushard cannot run with, in helm's own words.

We test:
- every values file in values/good renders, and the config.yaml it renders is one webhook/settings.py
  accepts (the schema allows nothing the programs refuse at start);
- the settings this version added (policy.newNodeCards, policy.newNodeCardMemoryMiB) are written into config.yaml
  only when set, so that the version before, which refuses a key it does not know, reads the default ConfigMap
  during an upgrade or a rollback (docs/upgrade.md);
- every values file in values/bad makes `helm template` fail with the message its first line expects
  (helm's own text: the key's path and the allowed values), and one makes `helm lint --strict` fail too;
- a devicePolicy entry that is no name (a space, a quote, a new line) is refused even with the schema
  skipped (`--skip-schema-validation`), by the template that writes it into a CEL string literal, with a
  message naming the value; names are written in, joined by single spaces;
- the schema's choices are the programs' own: each enum is the tuple webhook/core/policy.py checks, and
  sharesPerCard stops where settings.py stops;
- the schema is draft-07 and closed (additionalProperties: false) at the top and in every object of its
  own, so a misspelt value fails instead of being ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.chart import helm
from webhook import settings
from webhook.core import policy

helm.skip_module_without_helm()
pytestmark = pytest.mark.usefixtures("helm_binary")

VALUES = Path(__file__).parent / "values"
SCHEMA = json.loads((helm.CHART / "values.schema.json").read_text())
GOOD = sorted((VALUES / "good").glob("*.yaml"))
BAD = sorted((VALUES / "bad").glob("*.yaml"))


def expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name}: the first line says what helm must answer"
    return first.removeprefix("# expect: ")


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_good_values_render_a_config_gpushard_accepts(path):
    objects = helm.template(yaml.safe_load(path.read_text()))
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpushard-config")
    settings.from_mapping(yaml.safe_load(config["data"]["config.yaml"]), source=path.name)


def rendered_policy(values: dict) -> dict:
    objects = helm.template(values)
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpushard-config")
    return yaml.safe_load(config["data"]["config.yaml"])["policy"]


def test_settings_this_version_added_are_written_only_when_set():
    assert not {"newNodeCards", "newNodeCardMemoryMiB"} & set(rendered_policy({}))
    assert rendered_policy({"config": {"policy": {"newNodeCards": 8}}})["newNodeCards"] == 8
    both = rendered_policy({"config": {"policy": {"newNodeCards": 8, "newNodeCardMemoryMiB": 81920}}})
    assert (both["newNodeCards"], both["newNodeCardMemoryMiB"]) == (8, 81920)


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_values_fail_naming_the_key(path):
    done = helm.run("template", helm.RELEASE, str(helm.CHART), values=yaml.safe_load(path.read_text()), check=False)
    assert done.returncode != 0, f"{path.name} rendered"
    assert "values don't meet the specifications of the schema" in done.stderr
    assert expected(path) in done.stderr, done.stderr


def test_lint_fails_on_bad_values():
    path = VALUES / "bad" / "backend.yaml"
    done = helm.run("lint", "--strict", str(helm.CHART), values=yaml.safe_load(path.read_text()), check=False)
    assert done.returncode != 0
    assert expected(path) in done.stdout + done.stderr


@pytest.mark.parametrize("entry", ["a b", "nic''' || true || r'''", "x\ny", "Upper", "ns/sa,other"])
def test_device_policy_entries_that_are_no_names_fail_without_the_schema(entry):
    for key in ("exemptNamespaces", "exemptServiceAccounts", "allowedDeviceClasses"):
        done = helm.run("template", helm.RELEASE, str(helm.CHART), "--skip-schema-validation",
                        values={"devicePolicy": {key: ["ok", entry]}}, check=False)
        assert done.returncode != 0, (key, entry)
        assert f"gpushard: devicePolicy.{key} holds {json.dumps(entry)}, which is no name" in done.stderr, done.stderr


def test_device_policy_names_are_written_into_the_policies():
    values = {"devicePolicy": {"exemptNamespaces": ["gpu-operator", "monitoring"],
                               "exemptServiceAccounts": ["gpu-monitoring/dcgm-exporter"],
                               "allowedDeviceClasses": ["nic.example.com", "fpga.example.com"]}}
    expressions = {(o["metadata"]["name"], v["name"]): v["expression"] for o in helm.template(values)
                   if o["kind"] == "ValidatingAdmissionPolicy" for v in o["spec"].get("variables", [])}
    q = "'''"
    assert expressions["gpushard-device-channels", "trustedNamespaces"] == f"r{q}gpu-operator monitoring{q}"
    assert expressions["gpushard-device-channels", "trustedServiceAccounts"] == f"r{q}gpu-monitoring/dcgm-exporter{q}"
    assert expressions["gpushard-device-claims", "allowed"] == f"r{q}nic.example.com fpga.example.com{q}"
    assert expressions["gpushard-device-claims", "own"] == f"r{q}{q}"


def _at(*keys: str) -> dict:
    node = SCHEMA
    for key in keys:
        node = node["properties"][key]
    return node


@pytest.mark.parametrize("keys,choices", [
    (("backend",), policy.BACKENDS),
    (("isolation",), policy.ISOLATIONS),
    (("config", "policy", "wholeCards"), policy.WHOLE_CARDS),
    (("config", "policy", "multiCard"), policy.MULTI_CARD),
    (("config", "policy", "placement"), policy.PLACEMENTS),
    (("config", "policy", "nodeAffinity"), policy.NODE_AFFINITIES),
    (("config", "policy", "memorySize"), policy.MEMORY_SIZES),
])
def test_enums_are_the_programs_choices(keys, choices):
    assert tuple(_at(*keys)["enum"]) == tuple(choices), ".".join(keys)


def test_device_list_strategies_and_shares_per_card_are_the_programs():
    assert tuple(_at("config", "deviceListStrategy")["items"]["enum"]) == policy.DEVICE_LIST_STRATEGIES
    shares = _at("config", "sharesPerCard")
    assert (shares["minimum"], shares["maximum"]) == (1, settings.MAX_SHARES_PER_CARD)


def _objects(node: dict, path: str = ""):
    if node.get("type") == "object" and "properties" in node:
        yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _objects(child, f"{path}.{key}")


def test_schema_is_closed():
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    open_ = [path or "(top)" for path, node in _objects(SCHEMA) if node.get("additionalProperties") is not False]
    assert not open_, f"objects that would take any key: {open_}"


def test_every_value_has_a_schema_entry():
    def leaves(values: dict, schema: dict, path: str = ""):
        for key, value in values.items():
            assert key in schema.get("properties", {}), f"{path}{key} is in values.yaml but not in the schema"
            child = schema["properties"][key]
            if isinstance(value, dict) and value and "properties" in child:
                yield from leaves(value, child, f"{path}{key}.")

    list(leaves(yaml.safe_load((helm.CHART / "values.yaml").read_text()), SCHEMA))
