"""We test the agent's reading of NVIDIA's container toolkit config (webhook/agent/node/toolkitcheck.py), on real files:
- the toolkit's defaults (no key set), an explicit true and a hardened file: only the hardened one keeps an
  unprivileged container's NVIDIA_VISIBLE_DEVICES from the cards; each verdict names the file and the key;
- the first candidate that exists is read (the GPU Operator's before /etc); none at all judges nothing and
  says so; a file that is not TOML, a key that is not a boolean, or an unreadable file is reported, never a crash;
- the checker logs a new verdict once, at WARNING while the promise is broken, and not again while it holds;
- every card's entry of the Node's inventory carries the verdict (the agent's keys on its Node stay three),
  and the agent's metrics say 1 or 0 (none while nothing was found);
- `gpushard audit` and `gpushard status` name a shared node whose agent found the defaults, with the fix, and
  say nothing of a hardened node or of a node that is not shared.
"""

from __future__ import annotations

import json
import logging

import pytest

from webhook.agent import running
from webhook.agent.metrics import exporting
from webhook.agent.node import nvml, publishing, toolkitcheck
from webhook.auditing import node_lines, toolkit_problems
from webhook.core import auditing, names
from webhook.core.policy import Policy

HARDENED = (f"{toolkitcheck.ENVVAR_KEY} = false\n{toolkitcheck.MOUNTS_KEY} = true\n\n"
            "[nvidia-container-runtime]\nmode = \"cdi\"\n")
DEFAULTS = "[nvidia-container-runtime]\nmode = \"auto\"\n"  # what a fresh install writes: neither key


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_defaults_accept_the_variable_and_a_hardened_file_does_not(tmp_path):
    defaults = toolkitcheck.read([write(tmp_path, "defaults.toml", DEFAULTS)])
    assert (defaults.hardened, defaults.accept_envvar_unprivileged, defaults.accept_volume_mounts) == (False, True,
                                                                                                      False)
    assert "not set, the toolkit's default: true" in defaults.message()
    assert "sees every card of this node" in defaults.message() and str(tmp_path) in defaults.message()
    explicit = toolkitcheck.read([write(tmp_path, "true.toml", f"{toolkitcheck.ENVVAR_KEY} = true\n")])
    assert explicit.hardened is False and f"{toolkitcheck.ENVVAR_KEY} = true" in explicit.message()
    hardened = toolkitcheck.read([write(tmp_path, "hardened.toml", HARDENED)])
    assert (hardened.hardened, hardened.accept_volume_mounts) == (True, True)
    assert "ignores NVIDIA_VISIBLE_DEVICES" in hardened.message()


def test_a_key_inside_a_table_is_not_the_top_level_key(tmp_path):
    # The toolkit reads the two keys at the top level only: under a table they change nothing.
    text = f"[nvidia-container-runtime]\n{toolkitcheck.ENVVAR_KEY} = false\n"
    assert toolkitcheck.read([write(tmp_path, "c.toml", text)]).hardened is False


def test_the_first_existing_candidate_is_read_and_none_judges_nothing(tmp_path):
    operator = write(tmp_path, "operator.toml", HARDENED)
    etc = write(tmp_path, "etc.toml", DEFAULTS)
    missing = str(tmp_path / "absent.toml")
    assert toolkitcheck.read([missing, operator, etc]).path == operator
    assert toolkitcheck.read([missing, etc, operator]).hardened is False
    nothing = toolkitcheck.read([missing])
    assert (nothing.path, nothing.hardened) == (None, None)
    assert "no NVIDIA container toolkit config" in nothing.message([missing]) and missing in nothing.message([missing])
    assert nothing.as_json() == {"config": None, "hardened": None, "acceptEnvvarWhenUnprivileged": None,
                                 "acceptVolumeMounts": None}


@pytest.mark.parametrize("text, says", [
    ("accept = [", "not TOML"),
    (f'{toolkitcheck.ENVVAR_KEY} = "false"\n', "not true or false"),
    (b"\xff\xfe".decode("latin-1"), None),
])
def test_a_broken_file_is_reported_not_judged(tmp_path, text, says):
    path = tmp_path / "c.toml"
    if says is None:
        path.write_bytes(b"\xff\xfe\x00")
    else:
        path.write_text(text)
    verdict = toolkitcheck.read([str(path)])
    assert verdict.hardened is None and verdict.error, verdict
    if says:
        assert says in verdict.error
    assert "cannot read NVIDIA's container toolkit config" in verdict.message()
    assert verdict.as_json()["error"] == verdict.error


def test_an_unreadable_file_is_reported(tmp_path):
    folder = tmp_path / "c.toml"
    folder.mkdir()  # reading a folder fails as an unreadable file does
    verdict = toolkitcheck.read([str(folder)])
    assert verdict.path == str(folder) and verdict.error and verdict.hardened is None


def test_the_checker_logs_each_new_verdict_once(tmp_path, caplog):
    path = tmp_path / "config.toml"
    path.write_text(DEFAULTS)
    checker = toolkitcheck.Checker([str(path)])
    with caplog.at_level(logging.INFO, logger="webhook.agent.node.toolkitcheck"):
        checker.check()
        checker.check()
        path.write_text(HARDENED)
        checker.check()
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(records) == 2, records
    assert records[0][0] == logging.WARNING and "accepts NVIDIA_VISIBLE_DEVICES" in records[0][1]
    assert records[1][0] == logging.INFO and "ignores NVIDIA_VISIBLE_DEVICES" in records[1][1]
    assert checker.verdict.hardened is True


def test_every_cards_inventory_entry_carries_the_verdict(tmp_path):
    checker = toolkitcheck.Checker([write(tmp_path, "c.toml", DEFAULTS)])
    cards = [nvml.Card(0, "GPU-a", "Fake", 16384), nvml.Card(1, "GPU-b", "Fake", 16384)]
    agent = running.Agent(nvml.FakeDevices(cards), Policy(), str(tmp_path), toolkit=checker)
    patch = publishing.node_patch(cards, agent.inventory_details())
    entries = json.loads(patch["metadata"]["annotations"][names.INVENTORY_ANNOTATION])
    assert [e[names.INVENTORY_TOOLKIT]["hardened"] for e in entries] == [False, False]
    assert entries[0][names.INVENTORY_TOOLKIT]["config"] == str(tmp_path / "c.toml")
    assert set(patch["metadata"]["annotations"]) == {names.INVENTORY_ANNOTATION}
    # An agent without the check says nothing of the toolkit.
    plain = running.Agent(nvml.FakeDevices(cards), Policy(), str(tmp_path))
    assert all(names.INVENTORY_TOOLKIT not in e for e in json.loads(publishing.node_patch(
        cards, plain.inventory_details())["metadata"]["annotations"][names.INVENTORY_ANNOTATION]))


@pytest.mark.parametrize("hardened, value", [(True, 1), (False, 0), (None, None)])
def test_the_metric_says_whether_the_node_is_hardened(hardened, value):
    obs = exporting.Observation("node-a", 100, [], True, toolkit_hardened=hardened)
    text = "".join(f"{m.name} {s.value}\n" for m in exporting.families(obs) for s in m.samples
                   if m.name == "gpushard_agent_toolkit_hardened")
    assert text == ("" if value is None else f"gpushard_agent_toolkit_hardened {value}\n")


def node(name: str, verdict: dict | None, shared: bool = True) -> dict:
    entries = [{"index": k, "uuid": f"GPU-{k}", "model": "Fake", "memoryMiB": 16384,
                **({names.INVENTORY_TOOLKIT: verdict} if verdict is not None else {})} for k in range(2)]
    annotations = {names.INVENTORY_ANNOTATION: json.dumps(entries)} if shared else {}
    labels = {names.CARDS_LABEL: "2"} if shared else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "annotations": annotations,
                                                              "labels": labels}, "status": {}}


def test_audit_and_status_name_the_shared_node_whose_toolkit_accepts_the_variable():
    accepting = toolkitcheck.Verdict("/etc/nvidia-container-runtime/config.toml", True, False).as_json()
    hardened = toolkitcheck.Verdict("/etc/nvidia-container-runtime/config.toml", False, True).as_json()
    nodes = [node("open", accepting), node("closed", hardened), node("plain", accepting, shared=False),
             node("unknown", toolkitcheck.Verdict().as_json()), node("old-agent", None)]
    items = auditing.audit([auditing.Located(n) for n in nodes], Policy())
    found = [(i.ref.name, i.finding.rule) for i in items if i.finding.rule == auditing.TOOLKIT_ACCEPTS_ENVVAR]
    assert found == [("open", auditing.TOOLKIT_ACCEPTS_ENVVAR)]
    problems = toolkit_problems(nodes)
    assert [name for name, _ in problems] == ["open"]
    assert toolkit_problems(nodes, picked={"closed"}) == []
    lines = node_lines(problems[:1])
    assert lines.startswith('node: on shared node "open" NVIDIA\'s container toolkit accepts')
    assert "/etc/nvidia-container-runtime/config.toml" in lines
    assert "fix: set accept-nvidia-visible-devices-envvar-when-unprivileged = false" in lines
