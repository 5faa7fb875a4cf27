"""`gpushard audit` and `gpushard status` against a live cluster: the real kubernetes client talking to tests/fakekube.

We test:
- the audit of a cluster with namespaces in every mode, shared and plain nodes, pinned, unpinned,
  finished and pending pods and workloads reports exactly the expected findings, exit status 1;
- the table groups findings by object, names rule, container and fix, and fits 120 columns;
- every list goes through the API (core, apps/v1, batch/v1, resource.k8s.io/v1), owned ReplicaSets and Jobs
  are not audited twice, and a workload kind the API refuses is skipped with a note, not fatal;
- DeviceClasses of other drivers serving extended resources: each serving gpushard's shares or a card name,
  or nvidia.com/gpu, is a finding on DeviceClass/<name>, and the pods beside them get the webhook's findings;
  an API server without resource.k8s.io/v1 (404) has none, without a note; a refused list is skipped with a
  note; `audit -n` reads no DeviceClass (cluster-scoped, as nodes);
- the API location comes from --kubeconfig, from $KUBECONFIG, else the in-cluster service
  account, and --context picks a context; finished pods are left out by a field selector;
- an unreachable API or a refused pod list exits 3, an unreadable kubeconfig 2, each with one
  gpushard: line;
- a clean cluster exits 0;
- a namespace relabelled from audit to enforce keeps the findings of its running pods, which
  admission never sees again (a GPU-less sidecar still sees every card), with recreating the pod
  as their fix;
- running pods that ask for no GPU on a shared node in an opted-in namespace, and ephemeral
  containers of running GPU pods, are `unhidden` unless they carry NVIDIA_VISIBLE_DEVICES=void
  (init containers, sidecars, app containers and ephemeral containers alike), naming node and
  container; pods off shared nodes, not yet on a node, or in namespaces that have not opted in are
  not, until their namespace opts in; hideUnrequestedGpus: false means no such finding;
- host access in running pods of opted-in namespaces (a privileged debug container, hostPID, a
  hostPath of /dev) is reported by rule and container; the same in a namespace that did not opt
  in is not gpushard's to judge;
- an unexpected error in audit or status exits 2 with one gpushard: line, its traceback only with
  --debug;
- status: shares used and free per card and node, holders, totals, pending pods, finished pods
  not counted, and a card the node no longer offers kept visible with its holders; JSON too.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests import fakekube
from tests.audit import world
from webhook import cli
from webhook.core import auditing


def audit_json(argv: list[str], capsys) -> tuple[int, dict, str]:
    code = cli.main(["audit", "-o", "json", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def found(report: dict) -> set[tuple[str, str, str]]:
    return {(x["kind"], f"{x['namespace']}/{x['name']}" if x["namespace"] else x["name"], x["rule"])
            for x in report["findings"]}


def test_audit_reports_the_expected_findings(kubeconfig, capsys):
    code, report, err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert code == 1
    assert err == ""
    assert found(report) == world.EXPECTED
    assert report["target"] == "cluster"
    # One finding per rule and object, but ml/etl's three GPU-less containers each have their own.
    assert report["summary"]["findings"] == len(report["findings"]) == len(world.EXPECTED) + 2
    by_rule = {x["rule"]: x for x in report["findings"]}
    assert by_rule["pin-env-mismatch"]["container"] == "train"
    assert unhidden(report) == {"lab/notebook": ["proxy"], "lab/shell": ["shell"],
                                "ml/etl": ["download", "metrics", "etl"], "ml/train-b": ["debug"]}
    assert all(x["fix"] and x["message"].startswith("gpushard: ") and x["source"] is None
               for x in report["findings"])


def unhidden(report: dict) -> dict[str, list[str]]:
    """The containers of each pod that the audit says may see every card, in report order."""
    out: dict[str, list[str]] = {}
    for x in report["findings"]:
        if x["rule"] == "unhidden":
            out.setdefault(f"{x['namespace']}/{x['name']}", []).append(x["container"])
    return out


def test_audit_table_groups_by_object(kubeconfig, capsys):
    code = cli.main(["audit", "--kubeconfig", kubeconfig])
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert code == 1
    headers = [line for line in lines if line and not line.startswith(" ") and not line.startswith("gpushard:")]
    assert headers == ["Namespace legacy", "Node gpu-2x", "Pod lab/notebook", "Pod lab/shell", "Pod legacy/batch",
                       "Pod ml/etl", "Pod ml/loose", "Pod ml/train-b", "Pod research/legacy", "Pod research/plain",
                       "Deployment research/trainer"]
    research = lines[lines.index("Pod research/legacy") + 1:lines.index("Pod research/plain")]
    assert [line.split()[1] for line in research if line.startswith("  warn")] == [
        "not-opted-in", "nvidia-gpu-on-shared-node"]
    assert '  warn  unhidden  container "proxy"' in lines
    assert lines[-1] == "gpushard: 14 findings (14 warn) in 11 of 31 objects"
    assert max(map(len, lines)) <= 120


def test_finished_pods_are_not_audited(kubeconfig, fake, capsys):
    # Finished pods that would break rules were they running.
    fake.put("pods", world.pod("research", "old", [world.container("t", {"nvidia.com/gpu": "1"})], "gpu-2x",
                               "Succeeded"))
    _code, report, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    names = {x["name"] for x in report["findings"]}
    assert not names & {"old", "done", "crashed"}


def test_every_list_goes_through_the_api(kubeconfig, fake, capsys):
    audit_json(["--kubeconfig", kubeconfig], capsys)
    paths = {path.split("?")[0] for method, path, _body in fake.requests if method == "GET"}
    assert paths == {"/api/v1/namespaces", "/api/v1/nodes", "/api/v1/pods", "/apis/apps/v1/deployments",
                     "/apis/apps/v1/statefulsets", "/apis/apps/v1/daemonsets", "/apis/apps/v1/replicasets",
                     "/apis/batch/v1/jobs", "/apis/batch/v1/cronjobs", "/api/v1/replicationcontrollers",
                     "/api/v1/podtemplates", "/apis/resource.k8s.io/v1/deviceclasses",
                     # The install's own objects (core/installation.py); this cluster has no webhook configuration,
                     # so neither its Service's namespace nor its EndpointSlices are read.
                     "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
                     "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
                     "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/gpushard",
                     "/api/v1/namespaces/gpushard-system/configmaps/gpushard-device-policy"}
    pods = next(path for method, path, _body in fake.requests if path.startswith("/api/v1/pods?"))
    assert "fieldSelector=status.phase%21%3DSucceeded%2Cstatus.phase%21%3DFailed" in pods


def test_owned_workloads_are_audited_through_their_owner(kubeconfig, fake, capsys):
    gpu = [world.container("t", {"nvidia.com/gpu": "1"})]
    owned = world.deployment("research", "trainer-5c8d", gpu)
    owned["metadata"]["ownerReferences"] = [{"kind": "Deployment", "name": "trainer", "controller": True}]
    fake.put("replicasets", owned)
    fake.put("replicasets", world.deployment("research", "bare", gpu))
    operated = world.deployment("research", "served", gpu)
    operated["metadata"]["ownerReferences"] = [{"kind": "InferenceService", "name": "s", "controller": True}]
    fake.put("deployments", operated)
    _code, report, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert ("ReplicaSet", "research/bare", "not-opted-in") in found(report)
    assert ("Deployment", "research/served", "not-opted-in") in found(report)  # its owner is not audited
    assert not {x for x in found(report) if x[1] == "research/trainer-5c8d"}


def test_a_refused_workload_kind_is_skipped_with_a_note(kubeconfig, fake, capsys):
    # namespaces, nodes and pods answer; the deployments list is forbidden.
    fake.fail_next = [0, 0, 0, 403]
    code, report, err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert code == 1
    assert err.startswith("gpushard: the Kubernetes API at http://127.0.0.1:")
    assert "forbids this account to list deployments (403 Forbidden: injected failure)" in err
    assert "deployments not audited" in err
    assert found(report) == world.EXPECTED - {("Deployment", "research/trainer", "not-opted-in")}


def _device_class(name: str, resource: str) -> dict:
    return {"metadata": {"name": name}, "spec": {"extendedResourceName": resource, "selectors": [
        {"cel": {"expression": f'device.driver == "{name}"'}}]}}


def test_device_classes_serving_gpushards_names_are_findings_and_deny_its_pods(kubeconfig, fake, capsys):
    _code, before, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    fake.put("deviceclasses", _device_class("gpu.example.com", "gpushard.io/card-0"))
    fake.put("deviceclasses", _device_class("gpu.nvidia.com", "nvidia.com/gpu"))
    fake.put("deviceclasses", _device_class("fpga.example.com", "example.com/fpga"))
    code, report, err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert (code, err) == (1, "")
    got = found(report)
    assert {x for x in got if x[0] == "DeviceClass"} == {
        ("DeviceClass", "gpu.example.com", "extended-resource-taken"),
        ("DeviceClass", "gpu.nvidia.com", "extended-resource-shared")}
    denied = {(x[0], x[1]) for x in got if x[2] == "extended-resource-taken" and x[0] != "DeviceClass"}
    assert ("Pod", "lab/notebook") in denied  # it holds shares: the webhook would deny it now
    # Every other finding of the cluster is still there (a denial cuts its own object's warnings short).
    assert {x for x in world.EXPECTED if (x[0], x[1]) not in denied} <= got
    assert report["summary"]["objects"] == before["summary"]["objects"] + 3


def test_a_cluster_without_resource_k8s_io_has_no_device_classes(kubeconfig, fake, capsys):
    fake.unserved.add("resource.k8s.io/v1")
    code, report, err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert (code, err) == (1, "")
    assert found(report) == world.EXPECTED


def test_a_refused_device_class_list_is_skipped_with_a_note(kubeconfig, fake, capsys):
    fake.put("deviceclasses", _device_class("gpu.example.com", "gpushard.io/gpu"))
    # namespaces, nodes, pods and the eight workload kinds answer; the DeviceClass list, last, is forbidden.
    fake.fail_next = [0] * 11 + [403]
    code, report, err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert code == 1
    assert "forbids this account to list deviceclasses (403 Forbidden" in err
    assert err.rstrip().endswith("; deviceclasses not audited") and len(err.strip().splitlines()) == 1
    assert found(report) == world.EXPECTED


def test_a_namespace_audit_reads_no_device_class(kubeconfig, fake, capsys):
    fake.put("deviceclasses", _device_class("gpu.example.com", "gpushard.io/gpu"))
    code, report, _err = audit_json(["-n", "research", "--kubeconfig", kubeconfig], capsys)
    assert not [x for x in report["findings"] if x["rule"] == "extended-resource-taken"]
    assert not [path for _method, path, _body in fake.requests if "deviceclasses" in path]


def test_a_refused_pod_list_exits_3(kubeconfig, fake, capsys):
    fake.fail_next = [0, 0, 403]
    code = cli.main(["audit", "--kubeconfig", kubeconfig])
    captured = capsys.readouterr()
    assert code == 3
    assert "forbids this account to list pods (403 Forbidden" in captured.err
    assert captured.out == ""


def test_kubeconfig_from_the_environment(kubeconfig, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    code, report, _err = audit_json([], capsys)
    assert code == 1
    assert found(report) == world.EXPECTED


def test_context_picks_the_cluster(fake, tmp_path, capsys):
    # The current context points nowhere; --context names the fake.
    text = world.kubeconfig(fake).replace("current-context: fake", "current-context: elsewhere")
    text = text.replace("contexts:\n", "contexts:\n- name: elsewhere\n  context: {cluster: nowhere, user: nobody}\n")
    text = text.replace("clusters:\n", "clusters:\n- name: nowhere\n  cluster: {server: 'http://127.0.0.1:9'}\n")
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    code, report, _err = audit_json(["--kubeconfig", str(path), "--context", "fake"], capsys)
    assert (code, found(report)) == (1, world.EXPECTED)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_api_exits_3(tmp_path, capsys):
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{closed_port()}'}}}}]\n"
        "users: [{name: u, user: {}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    for command in ("audit", "status"):
        code = cli.main([command, "--kubeconfig", str(path)])
        captured = capsys.readouterr()
        assert code == 3
        assert captured.err.startswith("gpushard: cannot reach the Kubernetes API at http://127.0.0.1:")
        assert "connection refused" in captured.err and "urllib3" not in captured.err
        assert captured.err.count("\n") == 1 and captured.out == ""


def test_unreadable_kubeconfig_exits_2(tmp_path, capsys):
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\ncurrent-context: missing\n")
    code = cli.main(["status", "--kubeconfig", str(path)])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"gpushard: cannot use {path} to reach the Kubernetes API")


def test_without_kubeconfig_the_service_account_is_tried(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    code = cli.main(["audit"])
    assert code == 2
    assert capsys.readouterr().err.startswith(
        "gpushard: cannot use the in-cluster service account to reach the Kubernetes API")


def test_clean_cluster_exits_0(tmp_path, capsys):
    with fakekube.FakeKube() as fake:
        fake.put("namespaces", world.namespace("ml", "enforce"))
        fake.put("nodes", world.shared_node("gpu-8x", 8, world.H100))
        fake.put("pods", world.pod("ml", "train", [world.pinned("t", 4, 50)], "gpu-8x", card=4, shares=50))
        path = tmp_path / "kubeconfig"
        path.write_text(world.kubeconfig(fake))
        code = cli.main(["audit", "--kubeconfig", str(path)])
    assert code == 0
    assert capsys.readouterr().out == "gpushard: no findings in 3 objects\n"


def test_running_pods_keep_their_findings_once_the_namespace_enforces(kubeconfig, fake, capsys):
    fake.put("namespaces", world.namespace("lab", "enforce"))
    code, report, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert code == 1
    assert found(report) == world.EXPECTED
    notebook = next(x for x in report["findings"] if x["rule"] == "unhidden" and x["name"] == "notebook")
    assert notebook["container"] == "proxy"
    assert notebook["message"].endswith("until it is recreated")
    assert notebook["fix"].startswith("recreate the pod")
    shell = next(x for x in report["findings"] if x["name"] == "shell")
    assert shell["message"].endswith("the pod was created before gpushard hid GPUs there and must be recreated")
    assert shell["fix"] == auditing.RECREATE_FIX
    # The lab Job's template is admitted again for each pod it makes: nothing to say about it.
    assert not [x for x in report["findings"] if x["kind"] == "Job"]


def test_gpu_less_pods_on_shared_nodes_that_predate_the_opt_in(kubeconfig, capsys):
    _code, report, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    by_container = {(x["name"], x["container"]): x for x in report["findings"] if x["rule"] == "unhidden"}
    # Enforce mode: created before gpushard hid GPUs in ml; init container, sidecar and app container.
    for name in ("download", "metrics", "etl"):
        x = by_container[("etl", name)]
        assert x["message"] == (
            f'gpushard: container "{name}" asks no GPU but may see every card of shared node "gpu-8x"; '
            "the pod was created before gpushard hid GPUs there and must be recreated")
        assert (x["severity"], x["fix"]) == ("warn", auditing.RECREATE_FIX)
    # A debug container added to a GPU pod before the namespace opted in.
    debug = by_container[("train-b", "debug")]
    assert debug["message"] == (
        'gpushard: ephemeral container "debug" asks no GPU but may see every card of shared node "gpu-8x"; '
        "it was added before gpushard hid GPUs there, so the pod must be recreated")
    assert debug["fix"] == auditing.RECREATE_FIX
    # Audit mode hides nothing: opting in to enforce is the fix, as for the GPU pod's proxy.
    shell = by_container[("shell", "shell")]
    assert shell["message"] == (
        'gpushard: container "shell" asks no GPU but may see every card of shared node "gpu-2x"')
    assert shell["fix"] == auditing.fix_for("unhidden")
    # Hidden by gpushard (ml/fetch, ml/etl's "logs", ml/train-a's debug container), off shared nodes
    # (ml/web), not yet on a node (ml/queued), or not opted in (research, kube-system): nothing.
    assert not {x["name"] for x in report["findings"]} & {
        "fetch", "train-a", "web", "queued", "tensorboard", "gpushard-agent-gpu-8x", "coredns"}
    assert ("etl", "logs") not in by_container


def test_gpu_less_pods_count_once_their_namespace_opts_in(kubeconfig, fake, capsys):
    fake.put("namespaces", world.namespace("research", "audit"))
    _code, report, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert unhidden(report)["research/tensorboard"] == ["tensorboard"]
    assert "research/web" not in unhidden(report)  # on a node gpushard does not share
    assert not [x for x in found(report) if x[2] == "not-opted-in"]


def test_no_unhidden_finding_when_gpushard_does_not_hide(kubeconfig, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\npolicy: {hideUnrequestedGpus: false}\n")
    code, report, _err = audit_json(["--kubeconfig", kubeconfig, "--config", str(config)], capsys)
    assert code == 1
    assert found(report) == {x for x in world.EXPECTED if x[2] != "unhidden"}


def test_host_access_in_running_pods(kubeconfig, fake, capsys):
    debug = {"name": "debugger-x", "image": "busybox", "securityContext": {"privileged": True}}
    grabbing = world.pod("ml", "grab", [world.hidden("peek")], "gpu-8x", ephemeral=[debug])
    grabbing["spec"]["hostPID"] = True
    grabbing["spec"]["volumes"] = [{"name": "dev", "hostPath": {"path": "/dev"}}]
    fake.put("pods", grabbing)
    outside = world.pod("research", "grab", [world.container("t", {"nvidia.com/gpu": "1"})], "cpu-1",
                        ephemeral=[debug])
    fake.put("pods", outside)
    code, report, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert code == 1
    mine = {(x["rule"], x["container"]) for x in report["findings"] if x["namespace"] == "ml" and x["name"] == "grab"}
    assert mine == {("privileged", "debugger-x"), ("host-pid", None), ("host-path", None), ("unhidden", "debugger-x")}
    privileged = next(x for x in report["findings"] if x["rule"] == "privileged")
    assert privileged["message"] == (
        'gpushard: ephemeral container "debugger-x" is privileged '
        "(spec.ephemeralContainers[0].securityContext.privileged), so it would see every card of the node")
    assert not [x for x in report["findings"] if x["namespace"] == "research" and x["rule"] == "privileged"]


def boom(*_args, **_kwargs):
    raise RuntimeError("unforeseen\nover two lines")


def test_an_unexpected_error_exits_2_in_one_line(kubeconfig, monkeypatch, capsys):
    monkeypatch.setattr(auditing, "audit", boom)
    monkeypatch.setattr(auditing, "usage", boom)
    for command in ("audit", "status"):
        code = cli.main([command, "--kubeconfig", kubeconfig])
        captured = capsys.readouterr()
        assert (code, captured.out) == (2, "")
        assert captured.err.count("\n") == 1
        assert captured.err.startswith(f"gpushard: {command} stopped by an unexpected error in test_live.py:")
        assert "RuntimeError: unforeseen over two lines; run it again with --debug" in captured.err
        code = cli.main([command, "--kubeconfig", kubeconfig, "--debug"])
        captured = capsys.readouterr()
        assert (code, captured.out) == (2, "")
        assert captured.err.startswith("Traceback (most recent call last):")
        assert captured.err.splitlines()[-1].startswith(f"gpushard: {command} stopped by an unexpected error")


# --- status ----------------------------------------------------------------------------------------

def status_json(kubeconfig: str, capsys, *extra: str) -> dict:
    assert cli.main(["status", "--kubeconfig", kubeconfig, "-o", "json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def memory_isolation(tmp_path) -> str:
    path = tmp_path / "config.yaml"
    path.write_text("isolation: memory\n")
    return str(path)


def test_status_counts_shares_per_card(kubeconfig, capsys, memory_isolation):
    report = status_json(kubeconfig, capsys, "--config", memory_isolation)
    nodes = {n["name"]: n for n in report["nodes"]}
    assert list(nodes) == ["gpu-2x", "gpu-8x"]  # the plain node is not shared
    big = {c["index"]: c for c in nodes["gpu-8x"]["cards"]}
    assert len(big) == 8
    assert (big[0]["used"], big[0]["free"], big[0]["capacity"]) == (75, 25, 100)
    # Each holder's memory cap under isolation: its shares of the card's 81559 MiB, floored.
    assert big[0]["pods"] == [{"namespace": "ml", "name": "train-a", "shares": 50, "memoryMiB": 40779},
                              {"namespace": "ml", "name": "train-b", "shares": 25, "memoryMiB": 20389}]
    assert big[1]["used"] == 0  # ml/done finished
    assert big[0]["model"] == world.H100 and big[0]["uuid"] == "GPU-gpu-8x-0"
    assert (nodes["gpu-8x"]["used"], nodes["gpu-8x"]["free"], nodes["gpu-8x"]["capacity"]) == (235, 565, 800)
    small = {c["index"]: c for c in nodes["gpu-2x"]["cards"]}
    assert small[1]["pods"] == [{"namespace": "lab", "name": "notebook", "shares": 40, "memoryMiB": 32623}]
    assert report["totals"] == {"nodes": 2, "cards": 10, "capacity": 1000, "used": 275, "free": 725}
    assert report["pending"] == [{"namespace": "ml", "name": "waiting", "card": 5, "shares": 20}]
    assert report["sharesPerCard"] == 100


def test_status_table(kubeconfig, capsys, memory_isolation):
    assert cli.main(["status", "--kubeconfig", kubeconfig, "--config", memory_isolation]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NODE", "CARD", "MODEL", "USED", "FREE", "TOTAL", "USE%", "PODS"]
    at = next(i for i, line in enumerate(lines) if line.startswith("gpu-8x") and line.split()[1] == "0")
    # Each holder shows its shares and its memory cap, all on the card's one line.
    assert lines[at].split()[-12:] == [
        "75", "25", "100", "75%", "ml/train-a", "(50,", "40779", "MiB),", "ml/train-b", "(25,", "20389", "MiB)"]
    assert [line.split()[:6] for line in lines if line.startswith("TOTAL")] == [
        ["TOTAL", "10", "275", "725", "1000", "27%"]]
    assert lines[-1] == "pending: ml/waiting waits for card 5 (20 shares)"


def test_with_isolation_none_status_shows_no_memory_cap(kubeconfig, capsys):
    report = status_json(kubeconfig, capsys)
    holders = [p for n in report["nodes"] for c in n["cards"] for p in c["pods"]]
    assert holders and all(p["memoryMiB"] is None for p in holders)
    assert cli.main(["status", "--kubeconfig", kubeconfig]) == 0
    out = capsys.readouterr().out
    assert "ml/train-a (50)," in out and "MiB" not in out


def test_a_selector_narrows_the_rows_not_the_verdicts(kubeconfig, fake, capsys):
    # ml/waiting waits for card 5, which only gpu-8x has (75 of its 100 shares free): pending, not
    # stranded, whether or not the selector shows gpu-8x.
    whole = status_json(kubeconfig, capsys)
    narrow = status_json(kubeconfig, capsys, "-l", "gpushard.io/cards=2")
    assert [n["name"] for n in narrow["nodes"]] == ["gpu-2x"]
    assert narrow["pending"] == whole["pending"] == [{"namespace": "ml", "name": "waiting", "card": 5, "shares": 20}]
    assert narrow["stranded"] == whole["stranded"] == []
    assert cli.main(["status", "--kubeconfig", kubeconfig, "-l", "gpushard.io/cards=2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "pending: ml/waiting waits for card 5 (20 shares)" and "stranded" not in out
    # A selector that matches nothing says so; the cluster still has its shared nodes.
    assert cli.main(["status", "--kubeconfig", kubeconfig, "-l", "pool=none"]) == 0
    out = capsys.readouterr().out
    assert "gpushard: no shared node matches -l pool=none (2 shared nodes in all)" in out
    assert "no shared nodes (none offers" not in out


def test_a_stranded_pod_is_told_once(kubeconfig, fake, capsys):
    # Fill card 5 of gpu-8x: ml/waiting now waits on a full card while others have room.
    filler = fake.get("pods", "waiting", "ml")
    filler["metadata"]["name"] = "filler"
    filler["spec"]["nodeName"] = "gpu-8x"
    filler["status"] = {"phase": "Running"}
    for c in filler["spec"]["containers"]:
        for section in ("requests", "limits"):
            for key in list(c.get("resources", {}).get(section, {})):
                c["resources"][section][key] = "100"
    fake.put("pods", filler)
    assert cli.main(["status", "--kubeconfig", kubeconfig]) == 0
    out = capsys.readouterr().out
    told = [line for line in out.splitlines() if "ml/waiting" in line]
    assert len(told) == 1 and told[0].startswith("stranded: ml/waiting waits on full card 5"), told


def test_a_card_the_node_no_longer_offers_keeps_its_holders(kubeconfig, fake, capsys):
    node = fake.get("nodes", "gpu-8x")
    node["status"]["allocatable"]["gpushard.io/card-3"] = "0"  # the agent marked card 3 unhealthy
    fake.put("nodes", node)
    card = status_json(kubeconfig, capsys)["nodes"][1]["cards"][3]
    assert (card["capacity"], card["used"], card["free"]) == (0, 100, 0)
    assert card["pods"] == [{"namespace": "ml", "name": "infer-c", "shares": 100, "memoryMiB": None}]
    _code, report, _err = audit_json(["--kubeconfig", kubeconfig], capsys)
    assert ("Node", "gpu-8x", "card-oversubscribed") in found(report)
