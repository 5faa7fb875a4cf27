"""We test gpushard's command line on real components, each command with no more than the shipped RBAC grants:
- `gpushard status` and `gpushard audit` as a person bound to the shipped gpushard-auditor ClusterRole (as in
  examples/auditor-binding.yaml): the node's cards and the shares pods hold, and the audit of the live cluster;
- `gpushard top` as a person bound to the shipped gpushard-top Role: it lists the agents and, where it cannot
  reach one's metrics (a runtime that starts no containers forwards no port), says so in one line;
- `gpushard replace --once --dry-run` with the replacer's own ServiceAccount token;
- the same commands as a user without the bindings end with exit code 3 and one line naming the denied right.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e import components, gpushard, objects

ROOT = Path(__file__).resolve().parents[2]


def run(config: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([gpushard.GPUSHARD, *args, f"--kubeconfig={config}", "--request-timeout=20s"],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def auditor(plane, kubectl, installed):
    kubectl.run("apply", "-f", str(ROOT / "examples" / "auditor-binding.yaml"))
    return plane.user_config("auditor", "e2e-auditor", ("gpu-admins",))


@pytest.fixture(scope="module")
def stranger(plane, installed):
    return plane.user_config("stranger", "e2e-stranger", ("nobody",))


@pytest.fixture(scope="module")
def top_user(plane, kubectl, installed):
    kubectl.apply(json.dumps({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "e2e-top", "namespace": gpushard.SYSTEM},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gpushard-top"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "e2e-top"}]}))
    return plane.user_config("top", "e2e-top")


def test_status_with_the_auditor_role(agent, kubectl, auditor, namespace):
    kubectl.run("apply", "-n", namespace, "-f", "-", input=objects.pod("shown", objects.container(gpu="0.3")))
    card = kubectl.json("get", "pod", "shown", "-n", namespace)["metadata"]["annotations"]["gpushard.io/card"]
    components.wait_for("the pod bound", lambda: kubectl.json("get", "pod", "shown", "-n", namespace)["spec"].get(
        "nodeName"), timeout=60)
    done = run(auditor, "status")
    assert done.returncode == 0, done.stderr
    assert components.NODE_NAME in done.stdout
    assert f"{namespace}/shown" in done.stdout, done.stdout
    lines = [line for line in done.stdout.splitlines() if f"{namespace}/shown" in line]
    assert any("30" in line for line in lines) and card in " ".join(lines)


def test_audit_with_the_auditor_role(installed, kubectl, auditor):
    done = run(auditor, "audit")
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stderr


def test_top_with_the_top_role(agent, top_user):
    done = run(top_user, "top")
    assert "Traceback" not in done.stderr
    if done.returncode:
        assert done.returncode == 3, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("gpushard:"), done.stderr


def test_replace_dry_run_with_its_service_account(plane, kubectl, installed):
    token = kubectl.token("gpushard-replacer", gpushard.SYSTEM)
    config = plane.token_config("replacer", token)
    done = subprocess.run([gpushard.GPUSHARD, "replace", "--once", "--dry-run", f"--namespace={gpushard.SYSTEM}",
                           "--identity=e2e"], capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL,
                          env={"KUBECONFIG": str(config), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [("status",), ("audit",), ("top",)])
def test_without_the_roles_one_line_and_exit_3(stranger, command):
    done = run(stranger, *command)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpushard:") and "forbidden" in lines[0].lower(), done.stderr
