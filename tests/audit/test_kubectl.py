"""kubectl's flags and habits, against tests/fakekube.py through the real kubernetes client.

We test:
- one kubeconfig loader, in kubectl's order: --kubeconfig, then $KUBECONFIG (a ':' list, merged,
  missing files skipped), then ~/.kube/config, then the in-cluster account; --context picks a
  context and an unknown one exits 2; --request-timeout takes kubectl's durations;
- a refused connection, a 401 and a 403 each exit 3 with one plain gpushard: line (no urllib3 text);
- `audit -n NS` uses only namespaced calls, so a token allowed only in NS audits it, while the
  cluster-wide audit with that token exits 3 naming the refused list; a namespace the token may not
  read is audited as if it enforced, with a note;
- -l reaches the API as a labelSelector; -A overrides -n; without -n the context's namespace is
  the one audited (as kubectl's default), and every namespace only where the context names none;
- -o json|yaml|wide|name and --no-headers for audit and status; status rows never wrap;
- status takes -A, --all-namespaces, -n and --namespace: -n narrows the pods shown, never the cards' numbers;
- `kubectl gpushard ...` (the kubectl-gpushard executable found on PATH by the real kubectl) runs
  the same commands, and setup.cfg installs it.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.audit import world
from webhook import cli, kubectlflags
from webhook.kubeapi import connecting

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str], capsys, plugin: bool = False) -> tuple[int, str, str]:
    code = (cli.plugin_main if plugin else cli.main)(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def kubeconfig_with(fake, tmp_path: Path, token: str | None = None, name: str = "kubeconfig") -> str:
    text = world.kubeconfig(fake)
    if token is not None:
        text = text.replace("user: {}", f"user: {{token: {token}}}")
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the loader ------------------------------------------------------------------------------------

def test_the_loader_follows_kubectls_order(fake, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    flag = kubeconfig_with(fake, tmp_path, name="flag")
    listed = kubeconfig_with(fake, tmp_path, name="listed")
    (home / ".kube/config").write_text(world.kubeconfig(fake))
    env = {"KUBECONFIG": f"{tmp_path / 'missing'}:{listed}"}
    assert connecting.kubeconfig_files(flag, env) == [flag]
    assert connecting.kubeconfig_files(None, env) == [listed]  # the missing file is skipped
    assert connecting.kubeconfig_files(None, {}) == [str(home / ".kube/config")]
    (home / ".kube/config").unlink()
    assert connecting.kubeconfig_files(None, {}) == []  # then the in-cluster account
    with pytest.raises(connecting.ConfigError, match="in-cluster service account"):
        connecting.client(environ={})
    with pytest.raises(connecting.ConfigError, match='--kubeconfig ".*missing": no such file'):
        connecting.client(str(tmp_path / "missing"))


def test_kubeconfig_lists_are_merged_as_kubectl_merges_them(fake, tmp_path, capsys, monkeypatch):
    # The first file holds the context, the second the cluster and user it names.
    text = yaml.safe_load(world.kubeconfig(fake))
    first = {"apiVersion": "v1", "kind": "Config", "current-context": "fake", "contexts": text["contexts"]}
    second = {"apiVersion": "v1", "kind": "Config", "clusters": text["clusters"], "users": text["users"]}
    (tmp_path / "a").write_text(yaml.safe_dump(first))
    (tmp_path / "b").write_text(yaml.safe_dump(second))
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    code, out, err = run(["status", "-o", "name"], capsys)
    assert (code, out, err) == (0, "node/gpu-2x\nnode/gpu-8x\n", "")


def test_an_unknown_context_exits_2(kubeconfig, capsys):
    code, out, err = run(["status", "--kubeconfig", kubeconfig, "--context", "nope"], capsys)
    assert (code, out) == (2, "") and err == (f'gpushard: --context "nope": no such context in {kubeconfig}; '
                                              'use one of "fake" (kubectl config get-contexts)\n')


@pytest.mark.parametrize("text, seconds", [("0", None), ("5", 5.0), ("30s", 30.0), ("1m30s", 90.0),
                                           ("500ms", 0.5), ("2h", 7200.0), ("1.5", 1.5)])
def test_request_timeouts_read_as_kubectl_reads_them(text, seconds):
    assert connecting.parse_timeout(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-1", "1d", "30 s", "inf", "nan", "s"])
def test_a_bad_request_timeout_exits_2(kubeconfig, capsys, text):
    code, out, err = run(["status", "--kubeconfig", kubeconfig, "--request-timeout", text], capsys)
    assert (code, out) == (2, "") and err.startswith(f"gpushard: --request-timeout {text!r}")


# --- an API that will not answer -------------------------------------------------------------------

def test_refused_connection_401_and_403_exit_3_in_plain_words(fake, tmp_path, capsys):
    fake.tokens = {"good": ("ml",)}
    nowhere = tmp_path / "nowhere"
    nowhere.write_text(world.kubeconfig(fake).replace(fake.url, f"http://127.0.0.1:{closed_port()}"))
    cases = [
        (str(nowhere), "cannot reach the Kubernetes API at http://127.0.0.1:", "connection refused"),
        (kubeconfig_with(fake, tmp_path, "stolen", "bad"), "refused the credentials (401 Unauthorized)",
         "log in again"),
        (kubeconfig_with(fake, tmp_path, "good", "good"), "forbids this account to list namespaces (403 Forbidden",
         'cannot get resource "namespaces"'),
    ]
    for command in ("status", "audit"):
        for path, said, also in cases:
            if command == "status" and "namespaces" in said:
                said = said.replace("list namespaces", "list nodes")
                also = also.replace("namespaces", "nodes")
            code, out, err = run([command, "--kubeconfig", path], capsys)
            assert (code, out) == (3, ""), err
            assert err.startswith("gpushard: ") and err.count("\n") == 1, err
            assert said in err and also in err and "(context fake)" in err
            for noise in ("urllib3", "HTTPConnection", "Max retries", "Traceback"):
                assert noise not in err


# --- a user with rights in one namespace -----------------------------------------------------------

def test_namespace_audit_needs_only_rights_in_that_namespace(fake, tmp_path, capsys):
    fake.tokens = {"research-only": ("research",)}
    path = kubeconfig_with(fake, tmp_path, "research-only")
    fake.requests.clear()
    code, out, err = run(["audit", "-n", "research", "--kubeconfig", path, "-o", "json"], capsys)
    assert code == 1, err
    assert err == ""
    report = json.loads(out)
    assert report["target"] == "namespace research"
    assert {(x["kind"], x["name"], x["rule"]) for x in report["findings"]} == {
        ("Pod", "legacy", "not-opted-in"), ("Pod", "plain", "not-opted-in"), ("Deployment", "trainer", "not-opted-in")}
    paths = [p for _method, p, _body in fake.requests]
    assert paths and all(p.startswith(("/api/v1/namespaces/research", "/apis/apps/v1/namespaces/research/",
                                       "/apis/batch/v1/namespaces/research/")) for p in paths), paths
    # The same user, the whole cluster: refused, and told which list was refused.
    code, out, err = run(["audit", "--kubeconfig", path], capsys)
    assert (code, out) == (3, "") and "forbids this account to list namespaces" in err


def test_a_namespace_whose_object_cannot_be_read_is_audited_as_enforced(fake, tmp_path, capsys):
    fake.tokens = {"t": ("research",)}
    path = kubeconfig_with(fake, tmp_path, "t")
    fake.fail_next = [403]  # the get of the Namespace itself is the first call
    code, out, err = run(["audit", "-n", "research", "--kubeconfig", path, "-o", "json"], capsys)
    assert code == 0
    assert err.startswith("gpushard: cannot read namespace research (403), so its gpushard.io/mode label is "
                          "unknown; its objects are audited as if it enforced gpushard")
    # Judged as enforced: what enforce mode would rewrite on admission is no finding ("not-opted-in" is
    # one only where the namespace is known to be out).
    assert json.loads(out)["findings"] == [] and json.loads(out)["summary"]["objects"] == 5
    fake.objects["namespaces"].pop(("", "research"))
    code, out, err = run(["audit", "-n", "research", "--kubeconfig", path], capsys)
    assert (code, out, err) == (2, "", f'gpushard: namespace "research" not found at the Kubernetes API at {fake.url} '
                                      "(context fake); check its name (kubectl get namespaces), or leave -n out\n")


def test_the_contexts_namespace_is_the_default_of_n_as_in_kubectl(fake, tmp_path, capsys):
    # A user whose context names their namespace, with rights only there: audit reads that namespace.
    fake.tokens = {"research-only": ("research",)}
    text = world.kubeconfig(fake).replace("user: {}", "user: {token: research-only}").replace(
        "context: {cluster: fake, user: nobody}", "context: {cluster: fake, user: nobody, namespace: research}")
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    code, out, err = run(["audit", "--kubeconfig", str(path), "-o", "json"], capsys)
    assert code == 1 and err == "" and json.loads(out)["target"] == "namespace research"
    # -A still means every namespace (and this token may not list them all), -n another one.
    code, out, err = run(["audit", "-A", "--kubeconfig", str(path)], capsys)
    assert code == 3 and "forbids this account to list namespaces" in err
    fake.tokens = None
    code, out, _ = run(["audit", "-n", "ml", "--kubeconfig", str(path), "-o", "json"], capsys)
    assert json.loads(out)["target"] == "namespace ml"


def test_all_namespaces_overrides_namespace_and_selector_reaches_the_api(kubeconfig, fake, capsys):
    fake.requests.clear()
    code, out, _ = run(["audit", "-n", "research", "-A", "--kubeconfig", kubeconfig, "-o", "json"], capsys)
    assert code == 1 and json.loads(out)["target"] == "cluster"
    fake.requests.clear()
    code, out, _ = run(["audit", "-A", "-l", "app=none", "--kubeconfig", kubeconfig, "-o", "json"], capsys)
    pods = [p for _m, p, _b in fake.requests if p.startswith("/api/v1/pods")]
    assert pods and all("labelSelector=app%3Dnone" in p for p in pods)
    assert not [x for x in json.loads(out)["findings"] if x["kind"] == "Pod"]
    code, out, _ = run(["status", "-l", "gpushard.io/cards=2", "--kubeconfig", kubeconfig, "-o", "name"], capsys)
    assert (code, out) == (0, "node/gpu-2x\n")


# --- output ----------------------------------------------------------------------------------------

def test_audit_outputs(kubeconfig, capsys):
    code, out, _ = run(["audit", "--kubeconfig", kubeconfig, "-o", "yaml"], capsys)
    code_json, out_json, _ = run(["audit", "--kubeconfig", kubeconfig, "-o", "json"], capsys)
    assert code == code_json == 1 and yaml.safe_load(out) == json.loads(out_json)
    code, out, _ = run(["audit", "--kubeconfig", kubeconfig, "-o", "name"], capsys)
    names = out.splitlines()
    assert code == 1 and len(names) == len(set(names))
    assert {"deployment.apps/trainer", "pod/legacy", "namespace/legacy", "node/gpu-2x"} <= set(names)
    code, out, _ = run(["audit", "--kubeconfig", kubeconfig, "-o", "wide"], capsys)
    lines = out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "KIND", "NAME", "CONTAINER", "SEVERITY", "RULE", "MESSAGE"]
    assert len(lines) == 1 + len(json.loads(out_json)["findings"])
    assert any(line.split()[:3] == ["research", "Deployment", "trainer"] for line in lines)
    _, bare, _ = run(["audit", "--kubeconfig", kubeconfig, "-o", "wide", "--no-headers"], capsys)
    assert [line.split() for line in bare.splitlines()] == [line.split() for line in lines[1:]]
    _, table, _ = run(["audit", "--kubeconfig", kubeconfig], capsys)
    _, plain, _ = run(["audit", "--kubeconfig", kubeconfig, "--no-headers"], capsys)
    assert table.splitlines()[-1].startswith(f"gpushard: {len(json.loads(out_json)['findings'])} findings")
    assert plain == table[:table.rindex("\n\ngpushard: ")] + "\n"


def test_status_outputs_never_wrap(kubeconfig, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    code, out, _ = run(["status", "--kubeconfig", kubeconfig], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["NODE", "CARD", "MODEL", "USED", "FREE", "TOTAL", "USE%", "PODS"]
    rows = [line for line in lines[1:] if not line.startswith("pending:")]
    # 2 + 8 cards, a total line for each node, one for the cluster: each on one line of its own.
    assert len(rows) == 10 + 2 + 1
    card0 = next(r for r in rows if r.startswith("gpu-8x     0"))
    assert "ml/train-a (50), ml/train-b (25)" in card0  # isolation none: no memory cap
    _, wide, _ = run(["status", "--kubeconfig", kubeconfig, "-o", "wide"], capsys)
    assert wide.splitlines()[0].split()[:4] == ["NODE", "CARD", "MODEL", "UUID"]
    assert "GPU-gpu-8x-3" in wide
    _, bare, _ = run(["status", "--kubeconfig", kubeconfig, "--no-headers"], capsys)
    assert not bare.startswith("NODE") and "TOTAL" not in bare
    assert len([line for line in bare.splitlines() if not line.startswith("pending:")]) == 12
    _, as_yaml, _ = run(["status", "--kubeconfig", kubeconfig, "-o", "yaml"], capsys)
    _, as_json, _ = run(["status", "--kubeconfig", kubeconfig, "-o", "json"], capsys)
    assert yaml.safe_load(as_yaml) == json.loads(as_json)


def test_review_outputs(capsys):
    files = [str(ROOT / "examples/demo/01-notebook-quarter.yaml"), str(ROOT / "examples/demo/08-bad-quantity.yaml")]
    code, out, err = run(["review", *files, "-o", "json"], capsys, plugin=True)
    listed = json.loads(out)
    assert code == 1 and listed["kind"] == "List" and len(listed["items"]) == 1
    assert "denied (403)" in err
    code, out, _ = run(["review", files[0], "-o", "name"], capsys, plugin=True)
    assert (code, out) == (0, "pod/notebook\n")


# --- the kubectl plugin ----------------------------------------------------------------------------

def test_the_plugin_offers_the_user_commands_with_one_flag_set():
    parser = cli.build_plugin_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    offered = set(sub.choices)
    expected = {c for c in cli.PLUGIN_COMMANDS if c != "top" or "top" in offered}
    assert offered == expected and {"status", "audit", "review"} <= offered


def test_setup_installs_the_kubectl_plugin():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in config["options.entry_points"]["console_scripts"].split("\n") if line)
    assert scripts["kubectl-gpushard"] == "webhook.cli:plugin_main"
    assert scripts["gpushard"] == "webhook.cli:main"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_finds_and_runs_the_plugin(kubeconfig, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    plugin = bin_dir / "kubectl-gpushard"
    # What the console_scripts entry installs, spelled out for this interpreter and source tree.
    plugin.write_text(f"#!{sys.executable}\nimport sys\nfrom webhook import cli\nsys.exit(cli.plugin_main())\n")
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    listed = subprocess.run(["kubectl", "plugin", "list"], env=env, capture_output=True, text=True, timeout=60)
    assert str(plugin) in listed.stdout
    done = subprocess.run(["kubectl", "gpushard", "status", "--kubeconfig", kubeconfig, "-o", "name"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "node/gpu-2x\nnode/gpu-8x\n"), done.stderr
    done = subprocess.run(["kubectl", "gpushard", "audit", "--kubeconfig", kubeconfig, "-n", "research", "-o",
                           "name"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == kubectlflags.FOUND and "deployment.apps/trainer" in done.stdout


def test_status_takes_kubectls_namespace_flags_and_narrows_only_the_pods_shown(kubeconfig, capsys):
    _, every, _ = run(["status", "--kubeconfig", kubeconfig, "-o", "json"], capsys)
    for flags in (["-A"], ["--all-namespaces"], ["-n", "ml", "-A"]):
        for plugin in (False, True):
            code, out, err = run(["status", *flags, "--kubeconfig", kubeconfig, "-o", "json"], capsys, plugin=plugin)
            assert (code, err) == (0, "") and out == every
    every = json.loads(every)
    for flags in (["-n", "ml"], ["--namespace", "ml"], ["--namespace=ml"]):
        code, out, err = run(["status", *flags, "--kubeconfig", kubeconfig, "-o", "json"], capsys, plugin=True)
        assert (code, err) == (0, "")
        narrowed = json.loads(out)
        assert narrowed["namespace"] == "ml"
        held = {p["name"] for n in narrowed["nodes"] for c in n["cards"] for p in c["pods"]}
        assert held == {"train-a", "train-b", "infer-c"}
        assert [p["name"] for p in narrowed["pending"]] == ["waiting"]
        # The cards' numbers are every namespace's: what a pod of ml can still have.
        assert narrowed["totals"] == every["totals"]
        assert [[c["used"] for c in n["cards"]] for n in narrowed["nodes"]] == \
            [[c["used"] for c in n["cards"]] for n in every["nodes"]]
    code, out, err = run(["status", "-n", "lab", "--kubeconfig", kubeconfig], capsys)
    assert (code, err) == (0, "")
    assert "lab/notebook (40)" in out and "ml/" not in out and "legacy/" not in out and "pending:" not in out
    assert "1 pod in lab on 2 nodes" in out.splitlines()[-1]
