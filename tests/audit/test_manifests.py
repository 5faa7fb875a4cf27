"""`gpushard audit -f`: reading manifests from files, folders and standard input, and its exit statuses.

We test:
- folders are read recursively (*.yaml, *.yml, *.json; other files ignored), multi-document YAML,
  empty documents and List kinds, and `-f -` reads standard input (as after `helm template`);
- each finding names the file and document it came from;
- a Namespace among the manifests gives its pods their mode; without one they are audited as if
  enforced (what enforce mode rewrites is no finding);
- a Pod as it exists in a cluster (uid, node, status), without its Namespace, keeps what enforce
  mode would have rewritten at its creation, with recreating the pod as its fix;
- a Pod that asks for no GPU is judged as the webhook would rewrite it: nothing to say while it is
  still to be created, or without its Namespace and shared Node among the manifests; an exported
  running one with both is `unhidden`, as in the live cluster;
- odd shapes are audited, not a crash: an env that is no list, entries that are no mappings,
  mapping keys that are not text (read as kubectl sends them); an env entry without a value shows
  as '';
- files found in a folder that hold no Kubernetes object (a dashboard, a cluster-view file) are
  skipped with one note, so `audit -f deploy/` and `-f examples/` work; named alone they are still
  an error;
- exit 0 when clean, 1 when anything is found, 2 with a gpushard: message naming the file (and the
  document) for a missing file, bad YAML, bad JSON, a document that is no object, an empty folder,
  and a bad config file.
"""

from __future__ import annotations

import io
import json
import textwrap

import pytest

from webhook import cli
from webhook.core import auditing

FRACTION_POD = textwrap.dedent("""\
    apiVersion: v1
    kind: Pod
    metadata: {name: NAME, namespace: ml}
    spec:
      containers:
      - name: train
        image: cuda:12
        resources: {limits: {nvidia.com/gpu: "QTY"}}
      - name: logs
        image: busybox
    """)


def pod(name: str, quantity: str = "0.5") -> str:
    return FRACTION_POD.replace("NAME", name).replace("QTY", quantity)


def run(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    code = cli.main(["audit", "-o", "json", *argv])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out else None), captured.err


def rules(report: dict) -> list[tuple[str, str, str]]:
    return [(x["name"], x["rule"], x["source"]) for x in report["findings"]]


def test_folders_are_read_recursively(tmp_path, capsys):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "one.yaml").write_text(pod("one", "1.5"))
    (tmp_path / "a" / "b" / "two.yml").write_text(pod("two", "0.333"))
    (tmp_path / "a" / "b" / "three.json").write_text(json.dumps({
        "apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "three"},
             "spec": {"containers": [{"name": "c", "resources": {"limits": {"gpushard.io/gpu": 500}}}]}}]}))
    (tmp_path / "a" / "notes.txt").write_text("not: [yaml")
    code, report, err = run(["-f", str(tmp_path)], capsys)
    assert (code, err) == (1, "")
    assert sorted(rules(report)) == [
        ("one", "fraction-above-one", f"{tmp_path}/a/one.yaml#1"),
        ("three", "bad-shares", f"{tmp_path}/a/b/three.json items[0]"),
        ("two", "rounded", f"{tmp_path}/a/b/two.yml#1"),
    ]
    assert report["summary"]["objects"] == 3


def test_multiple_documents_lists_and_empty_documents(tmp_path, capsys):
    listed = {"apiVersion": "v1", "kind": "PodList", "items": [{
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "in-list"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}]}
    text = "---\n" + pod("first", "0.25") + "---\n# only a comment\n---\n" + pod("second", "bad") + "---\n" + \
        json.dumps(listed) + "\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings}\n"
    path = tmp_path / "all.yaml"
    path.write_text(text)
    code, report, _err = run(["-f", str(path)], capsys)
    assert code == 1
    # A leading "---" opens the first document; a comment-only document counts, as kubectl counts it.
    assert rules(report) == [("in-list", "multi-card", f"{path}#4 items[0]"),
                             ("second", "bad-quantity", f"{path}#3")]
    assert report["summary"]["objects"] == 3  # the ConfigMap is not ours to audit


def test_standard_input(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(pod("piped", "1.5")))
    code, report, _err = run(["-f", "-"], capsys)
    assert code == 1
    assert rules(report) == [("piped", "fraction-above-one", "<stdin>#1")]


def test_namespace_manifests_give_the_mode(tmp_path, capsys):
    path = tmp_path / "chart.yaml"
    namespace = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ml\n  labels: {gpushard.io/mode: MODE}\n---\n"
    # Without a Namespace the pod is audited as if enforced: fine as written.
    path.write_text(pod("p"))
    assert run(["-f", str(path)], capsys)[0] == 0
    path.write_text(namespace.replace("MODE", "enforce") + pod("p"))
    assert run(["-f", str(path)], capsys)[0] == 0
    path.write_text(namespace.replace("MODE", "audit") + pod("p"))
    code, report, _err = run(["-f", str(path)], capsys)
    assert code == 1
    assert [r[:2] for r in rules(report)] == [("p", "fraction-unrewritten"), ("p", "unhidden")]
    path.write_text(namespace.replace("  labels: {gpushard.io/mode: MODE}\n", "") + pod("p"))
    code, report, _err = run(["-f", str(path)], capsys)
    assert [r[:2] for r in rules(report)] == [("p", "not-opted-in"), ("p", "fraction-unrewritten"),
                                              ("p", "unhidden")]


def test_an_exported_pod_keeps_what_enforce_mode_no_longer_fixes(tmp_path, capsys):
    path = tmp_path / "pod.yaml"
    path.write_text(pod("p", "0.5"))
    assert run(["-f", str(path)], capsys)[0] == 0  # still to be created: the webhook will hide "logs"
    path.write_text(pod("p", "0.5").replace("metadata: {name: p, namespace: ml}",
                                            "metadata: {name: p, namespace: ml, uid: 7c9a}"))
    code, report, _err = run(["-f", str(path)], capsys)
    assert code == 1
    assert [(x["rule"], x["container"]) for x in report["findings"]] == [
        ("fraction-unrewritten", "train"), ("unhidden", "logs")]
    assert {x["fix"] for x in report["findings"]} == {auditing.RECREATE_FIX}


GPU_LESS = textwrap.dedent("""\
    apiVersion: v1
    kind: Namespace
    metadata:
      name: ml
      labels: {gpushard.io/mode: enforce}
    ---
    apiVersion: v1
    kind: Node
    metadata:
      name: gpu-8x
      labels: {gpushard.io/cards: "8"}
    ---
    apiVersion: v1
    kind: Pod
    metadata: {name: etl, namespace: ml}
    spec:
      containers:
      - name: etl
        image: cuda:12
    """)


def test_gpu_less_pods_are_judged_as_the_webhook_rewrites_them(tmp_path, capsys):
    path = tmp_path / "etl.yaml"
    path.write_text(GPU_LESS)
    assert run(["-f", str(path)], capsys)[0] == 0  # still to be created: the webhook will hide "etl"
    running = GPU_LESS.replace("spec:\n", "spec:\n  nodeName: gpu-8x\n")
    without_namespace = running.split("---\n", 1)[1]
    path.write_text(without_namespace)
    assert run(["-f", str(path)], capsys)[0] == 0  # nothing says that its namespace opted in
    path.write_text(without_namespace.split("---\n", 1)[1])
    assert run(["-f", str(path)], capsys)[0] == 0  # nothing says that its node is shared
    path.write_text(running)
    code, report, _err = run(["-f", str(path)], capsys)
    assert code == 1
    assert [(x["rule"], x["container"], x["fix"]) for x in report["findings"]] == [
        ("unhidden", "etl", auditing.RECREATE_FIX)]
    assert 'every card of shared node "gpu-8x"' in report["findings"][0]["message"]


PINNED_POD = textwrap.dedent("""\
    apiVersion: v1
    kind: Pod
    metadata: {name: odd, namespace: ml}
    spec:
      containers:
      - name: train
        image: cuda:12
        env: ENV
        resources: {limits: {gpushard.io/gpu: 30, gpushard.io/card-0: 30, KEY: 1}}
    """)


@pytest.mark.parametrize("env, key", [("5", "example.com/fpga"), ("NVIDIA_VISIBLE_DEVICES=3", "example.com/fpga"),
                                      ("[7, [8], {value: '3'}]", "example.com/fpga"),
                                      ("[]", "7"), ("[]", "true"), ("[]", "null"), ("[]", "1.5")])
def test_odd_shapes_are_audited_not_a_crash(tmp_path, capsys, env, key):
    path = tmp_path / "odd.yaml"
    path.write_text(PINNED_POD.replace("ENV", env).replace("KEY", key))
    code, report, err = run(["-f", str(path)], capsys)
    assert (code, report["findings"], err) == (0, [], "")
    assert report["summary"]["objects"] == 1


def test_an_env_entry_without_a_value_sets_the_variable_empty(tmp_path, capsys):
    path = tmp_path / "odd.yaml"
    path.write_text(PINNED_POD.replace("ENV", "[7, {name: NVIDIA_VISIBLE_DEVICES}]").replace("KEY", "x"))
    code, report, _err = run(["-f", str(path)], capsys)
    assert code == 1
    assert [x["rule"] for x in report["findings"]] == ["pin-env-mismatch"]
    assert "sets NVIDIA_VISIBLE_DEVICES=''," in report["findings"][0]["message"]


def test_clean_manifests_exit_0_with_a_summary(tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text(pod("fine") + "---\n" + pod("also-fine", "250m"))
    assert cli.main(["audit", "-f", str(path)]) == 0
    assert capsys.readouterr().out == "gpushard: no findings in 2 objects\n"


def test_several_paths(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text(pod("a", "1.5"))
    (tmp_path / "b.yaml").write_text(pod("b", "3"))
    code, report, _err = run(["-f", str(tmp_path / "a.yaml"), "-f", str(tmp_path / "b.yaml")], capsys)
    assert code == 1
    assert [r[:2] for r in rules(report)] == [("a", "fraction-above-one"), ("b", "multi-card")]


@pytest.mark.parametrize("name, text, message", [
    ("bad.yaml", pod("ok") + "---\nkind: Pod\nmetadata: {name: [unclosed\n",
     "bad.yaml: document 2 is not valid YAML: "),
    ("bad.json", '{"kind": "Pod",', "bad.json: not valid JSON: "),
    ("scalar.yaml", pod("ok") + "---\njust text\n", "scalar.yaml#2: not a Kubernetes object"),
    ("kindless.yaml", "metadata: {name: x}\n", "kindless.yaml#1: not a Kubernetes object"),
])
def test_unreadable_documents_exit_2(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    code, report, err = run(["-f", str(path)], capsys)
    assert (code, report) == (2, None)
    assert err.startswith(f"gpushard: {tmp_path}/{message}")


def test_files_in_a_folder_that_hold_no_objects_are_skipped_with_one_note(tmp_path, capsys):
    (tmp_path / "dashboard.json").write_text(json.dumps({"title": "GPU shares", "panels": []}))
    (tmp_path / "cluster.yaml").write_text("nodes:\n- name: gpu-1\n  cards: [100]\n")
    (tmp_path / "pod.yaml").write_text(pod("one", "1.5"))
    code, report, err = run(["-f", str(tmp_path)], capsys)
    assert code == 1 and [r[:2] for r in rules(report)] == [("one", "fraction-above-one")]
    assert err == (f"gpushard: skipped 2 files that hold no Kubernetes objects: {tmp_path}/cluster.yaml, "
                   f"{tmp_path}/dashboard.json\n")
    # Named itself, such a file is still no manifest; nor is a folder file that mixes in a non-object.
    code, _report, err = run(["-f", str(tmp_path / "cluster.yaml")], capsys)
    assert code == 2 and "cluster.yaml#1: not a Kubernetes object" in err
    (tmp_path / "pod.yaml").write_text(pod("one", "1.5") + "---\njust text\n")
    code, _report, err = run(["-f", str(tmp_path)], capsys)
    assert code == 2 and "pod.yaml#2: not a Kubernetes object" in err


@pytest.mark.parametrize("folder", ["deploy", "examples"])
def test_the_projects_own_folders_audit(folder, capsys, monkeypatch):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])
    code, report, err = run(["-f", f"{folder}/"], capsys)
    assert code in (0, 1) and report["summary"]["objects"] > 0
    assert err.startswith("gpushard: skipped 1 file that holds no Kubernetes objects: ")


def test_missing_file_and_empty_folder_exit_2(tmp_path, capsys):
    code, _report, err = run(["-f", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2
    assert err == f"gpushard: cannot read {tmp_path}/nope.yaml: No such file or directory\n"
    code, _report, err = run(["-f", str(tmp_path)], capsys)
    assert code == 2
    assert err.startswith(f"gpushard: {tmp_path}: no *.yaml, *.yml or *.json files")


def test_bad_config_exits_2(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text(pod("p"))
    (tmp_path / "config.yaml").write_text("version: v1\nsharesPerCard: zero\n")
    code = cli.main(["audit", "-f", str(tmp_path / "p.yaml"), "--config", str(tmp_path / "config.yaml")])
    assert code == 2
    assert capsys.readouterr().err.startswith("gpushard: bad config: ")


def test_the_config_changes_the_rules(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text(pod("p", "0.333"))
    (tmp_path / "config.yaml").write_text("version: v1\nsharesPerCard: 1000\n")
    assert cli.main(["audit", "-f", str(tmp_path / "p.yaml"), "--config", str(tmp_path / "config.yaml")]) == 0
