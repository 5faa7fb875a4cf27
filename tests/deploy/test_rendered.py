"""The install manifests as `kubectl kustomize` renders them, checked against each other and against the
API server's rules that the schemas do not carry.

We test, for deploy/base, every overlay, examples/kind and examples/device-policy:
- kubectl renders the same objects as the test renderer (tests/deploy/rendering.py), and so it does
  for the operator's overlays the tests write (tests/deploy/devicepolicy.py), values that are no list
  of names (commas, new lines, quotes) included: each lands whole in its policy's string literal;
- no container is privileged with allowPrivilegeEscalation: false (the API server refuses the
  pair), and the agent patch docs/troubleshooting.md gives for privileged mode renders and passes;
- Jobs and the CronJob's job template clean up after themselves (ttlSecondsAfterFinished), the
  CronJob's name leaves room for the names of its Jobs, and every `kubectl create job` in the
  docs names a CronJob that exists and makes a fresh name each time;
- every reference resolves inside the rendering: service accounts, ConfigMaps, Secrets (made by
  the certificate Job or cert-manager), roles and subjects of bindings, the admission policy of
  its binding, the webhook's Service;
- fields the API server never lets change (selectors, roleRefs, Service type) are the same in
  every kustomization that has the object, so moving from one to another applies cleanly;
- the Pod Security labels of gpushard-system (enforce, warn, audit) admit every pod in it, so an
  apply prints no warning; only the agent needs more than "restricted";
- audit-only deploys no agent and nothing of it; cert-manager drops exactly the objects labelled
  app.kubernetes.io/component=certs, and the docs delete exactly those kinds when moving to it;
- the agent tolerates the taints GPU pools carry (any NoSchedule) but not every NoExecute;
- the image is named in one place (the base's `images:`), every rendered container uses it, and
  `make image` builds it with the engine found (a recording stand-in here), or says clearly
  that none was found.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import devicepolicy, rendering
from webhook import __version__
from webhook.core import placement

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
FOLDERS = [DEPLOY / "base", *sorted(p for p in (DEPLOY / "overlays").iterdir() if p.is_dir()), ROOT / "examples/kind",
           ROOT / "examples/device-policy"]
DOCS = {name: (ROOT / name).read_text() for name in ("README.md", "docs/install.md", "docs/helm.md",
                                                        "docs/getting-started.md", "docs/troubleshooting.md")}
NAMESPACE = "gpushard-system"
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


def kustomize(folder: Path) -> list[dict]:
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {str(folder.relative_to(ROOT)): kustomize(folder) for folder in FOLDERS}


def ident(obj: dict) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return obj["apiVersion"].rpartition("/")[0], obj["kind"], meta.get("namespace", ""), meta["name"]


def pod_specs(obj: dict) -> list[dict]:
    return rendering.pod_specs(obj)


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec.get("containers", [])


def find(objects: list[dict], kind: str, name: str, namespace: str = "") -> dict | None:
    return next((o for o in objects if ident(o)[1:] == (kind, namespace, name)), None)


def shell_lines(text: str) -> list[str]:
    """The command lines of a document's sh blocks, continuations joined, comments cut."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


# --- kubectl and the test renderer agree ---------------------------------------------------------

@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kubectl_renders_what_the_test_renderer_renders(folder, rendered):
    ours = {ident(o): o for o in rendering.render(folder)}
    theirs = {ident(o): o for o in rendered[str(folder.relative_to(ROOT))]}
    assert set(ours) == set(theirs)
    for key, obj in theirs.items():
        assert obj == ours[key], key


@pytest.mark.parametrize(("folder", "lists"), [
    ("base", {"exemptNamespaces": "gpu-operator other", "exemptServiceAccounts": "gpu-monitoring/dcgm-exporter"}),
    ("base", {"exemptNamespaces": "a,b\nc", "exemptServiceAccounts": "it's \"quoted\""}),
    ("overlays/dra", {"allowedDeviceClasses": "nic.example.com"}),
], ids=["names", "not-names", "dra"])
def test_kubectl_renders_operators_overlays_as_the_test_renderer(folder, lists, tmp_path):
    base = DEPLOY / folder
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(devicepolicy.overlay(base, tmp_path, **lists)))
    ours = {ident(o): o for o in rendering.render(tmp_path)}
    theirs = {ident(o): o for o in kustomize(tmp_path)}
    assert set(ours) == set(theirs)
    for key, obj in theirs.items():
        assert obj == ours[key], key
    expressions = [v["expression"] for o in theirs.values() if o["kind"] == "ValidatingAdmissionPolicy"
                   for v in o["spec"].get("variables", [])]
    for value in lists.values():
        assert f"r'''{value}'''" in expressions, value


# --- what the API server refuses that no schema says ----------------------------------------------

def _escalation_problems(spec: dict) -> list[str]:
    problems = []
    for c in containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is False:
            if sc.get("privileged") is True:
                problems.append(f"{c['name']}: privileged with allowPrivilegeEscalation: false")
            if "SYS_ADMIN" in ((sc.get("capabilities") or {}).get("add") or []):
                problems.append(f"{c['name']}: CAP_SYS_ADMIN with allowPrivilegeEscalation: false")
    return problems


def test_no_container_is_privileged_without_escalation(rendered):
    for folder, objects in rendered.items():
        for obj in objects:
            for spec in pod_specs(obj):
                assert _escalation_problems(spec) == [], f"{folder}: {obj['kind']} {obj['metadata']['name']}"


def test_the_documented_privileged_agent_overlay_is_accepted(tmp_path):
    text = DOCS["docs/troubleshooting.md"]
    section = text[text.index("### The agent finds no cards"):]
    block = re.search(r"```yaml\n(.*?)```", section, flags=re.S).group(1)
    overlay = yaml.safe_load(block)
    assert overlay["resources"] == ["../deploy/base"]
    (tmp_path / "deploy").symlink_to(DEPLOY)
    folder = tmp_path / "my-gpushard"
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(block)
    objects = kustomize(folder)
    agent = find(objects, "DaemonSet", "gpushard-agent", NAMESPACE)
    (container,) = agent["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["privileged"] is True
    assert _escalation_problems(agent["spec"]["template"]["spec"]) == []


def test_jobs_clean_up_and_cron_names_leave_room(rendered):
    for folder, objects in rendered.items():
        for obj in objects:
            if obj["kind"] == "Job":
                # Its template is immutable: a later apply with a new image must find it gone.
                assert obj["spec"].get("ttlSecondsAfterFinished"), f"{folder}: Job {obj['metadata']['name']}"
            if obj["kind"] == "CronJob":
                # The controller appends 11 characters to name each Job; the API server refuses more than 52.
                assert len(obj["metadata"]["name"]) <= 52
                assert obj["spec"]["jobTemplate"]["spec"].get("ttlSecondsAfterFinished"), folder


def test_documented_jobs_from_cron_jobs_get_fresh_names(rendered):
    cron_jobs = {o["metadata"]["name"] for o in rendered["deploy/base"] if o["kind"] == "CronJob"}
    found = 0
    for name, text in DOCS.items():
        for line in shell_lines(text) + re.findall(r"`(kubectl [^`]*create job[^`]*)`", text):
            if "create job" not in line:
                continue
            found += 1
            words = shlex.split(line)
            source = next(w for w in words if w.startswith("--from=cronjob/")).split("/", 1)[1]
            assert source in cron_jobs, f"{name}: {line}"
            job = next(w for w in words[words.index("job") + 1:] if not w.startswith("-"))
            # A fresh name each run: made in place, or in a variable the page sets from a command.
            variable = re.fullmatch(r"\$\{?(\w+)\}?", job)
            fresh = "$(" in job or (variable and re.search(rf'^\s*{variable.group(1)}="[^"\n]*\$\(', text,
                                                            flags=re.M))
            assert fresh, f"{name}: `{line}` fails the second time it is run (a fixed Job name)"
    assert found >= 2


def test_every_reference_resolves(rendered):
    for folder, objects in rendered.items():
        ids = {ident(o) for o in objects}
        secrets_made = {s.removeprefix("--secret=") for o in objects for spec in pod_specs(o)
                        for c in containers(spec) for s in c.get("args", []) if s.startswith("--secret=")}
        secrets_made |= {o["spec"]["secretName"] for o in objects if o["kind"] == "Certificate"}
        for obj in objects:
            ns = obj["metadata"].get("namespace", "")
            for spec in pod_specs(obj):
                assert ("", "ServiceAccount", ns, spec["serviceAccountName"]) in ids, (folder, obj["metadata"]["name"])
                for volume in spec.get("volumes", []):
                    if "configMap" in volume:
                        assert ("", "ConfigMap", ns, volume["configMap"]["name"]) in ids, (folder, volume)
                    if "secret" in volume:
                        assert volume["secret"]["secretName"] in secrets_made, (folder, volume)
            if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                ref = obj["roleRef"]
                role_ns = ns if ref["kind"] == "Role" else ""
                assert ("rbac.authorization.k8s.io", ref["kind"], role_ns, ref["name"]) in ids, (folder, ref)
                for subject in obj["subjects"]:
                    if subject["kind"] == "ServiceAccount":
                        assert ("", "ServiceAccount", subject["namespace"], subject["name"]) in ids, (folder, subject)
            if obj["kind"] == "ValidatingAdmissionPolicyBinding":
                assert ("admissionregistration.k8s.io", "ValidatingAdmissionPolicy", "",
                        obj["spec"]["policyName"]) in ids, folder
            if obj["kind"] == "MutatingWebhookConfiguration":
                for hook in obj["webhooks"]:
                    service = hook["clientConfig"]["service"]
                    assert ("", "Service", service["namespace"], service["name"]) in ids, folder


IMMUTABLE = {"Deployment": [("spec", "selector")], "DaemonSet": [("spec", "selector")],
             "StatefulSet": [("spec", "selector")], "Service": [("spec", "type"), ("spec", "clusterIP")],
             "RoleBinding": [("roleRef",)], "ClusterRoleBinding": [("roleRef",)],
             "PodDisruptionBudget": [], "Secret": [("type",)]}


def _at(obj: dict, path: tuple[str, ...]):
    for key in path:
        obj = (obj or {}).get(key)
    return obj


def test_fields_that_never_change_agree_across_kustomizations(rendered):
    seen: dict[tuple, tuple[str, dict]] = {}
    for folder, objects in rendered.items():
        for obj in objects:
            for path in IMMUTABLE.get(obj["kind"], []):
                key = (ident(obj), path)
                value = _at(obj, path)
                if key in seen:
                    assert seen[key][1] == value, f"{obj['kind']} {path}: {seen[key][0]} and {folder} differ"
                else:
                    seen[key] = (folder, value)


# --- Pod Security ----------------------------------------------------------------------------------

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
LEVELS = ("privileged", "baseline", "restricted")


def pod_security_level(spec: dict) -> str:
    """The strictest Pod Security Standard a pod spec meets (the checks gpushard's pods can hit)."""
    baseline = not (spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC")
                    or any("hostPath" in v for v in spec.get("volumes", [])))
    for c in containers(spec):
        sc = c.get("securityContext") or {}
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if sc.get("privileged") or added - BASELINE_CAPABILITIES or any(p.get("hostPort") for p in c.get("ports", [])):
            baseline = False
    if not baseline:
        return "privileged"
    pod_sc = spec.get("securityContext") or {}
    for c in containers(spec):
        sc = c.get("securityContext") or {}
        if not (sc.get("allowPrivilegeEscalation") is False and (sc.get("capabilities") or {}).get("drop") == ["ALL"]
                and (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot"))
                and (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault"):
            return "baseline"
    return "restricted"


def test_the_namespace_labels_admit_every_pod_in_it_without_a_warning(rendered):
    for folder, objects in rendered.items():
        namespace = find(objects, "Namespace", NAMESPACE)
        labels = namespace["metadata"]["labels"]
        for mode in ("enforce", "warn", "audit"):
            level = labels.get(f"pod-security.kubernetes.io/{mode}")
            assert level in LEVELS, f"{folder}: {mode} must be set, or the cluster's default applies"
            for obj in objects:
                for spec in pod_specs(obj):
                    meets = pod_security_level(spec)
                    assert LEVELS.index(meets) >= LEVELS.index(level), \
                        f"{folder}: {obj['kind']} {obj['metadata']['name']} meets {meets}; {mode} is {level}"
        for obj in objects:
            for spec in pod_specs(obj):
                if obj["metadata"]["name"] != "gpushard-agent":
                    assert pod_security_level(spec) == "restricted", obj["metadata"]["name"]


# --- overlays --------------------------------------------------------------------------------------

def test_audit_only_runs_no_agent(rendered):
    objects = rendered["deploy/overlays/audit-only"]
    assert not [o for o in objects if o["kind"] == "DaemonSet"]
    assert not [ident(o) for o in objects if "agent" in o["metadata"]["name"]]
    text = DOCS["docs/install.md"]
    section = text[text.index("### A first dry run: audit only"):text.index("### With cert-manager")]
    assert "no node agent" in section and "NVIDIA's device plugin" in section


def test_cert_manager_drops_exactly_the_certs_objects_and_the_docs_delete_them(rendered):
    base = {ident(o): o for o in rendered["deploy/base"]}
    managed = {ident(o) for o in rendered["deploy/overlays/cert-manager"]}
    dropped = set(base) - managed
    labelled = {key for key, o in base.items()
                if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "certs"}
    assert dropped == labelled and dropped
    text = DOCS["docs/install.md"]
    start = text.index("### With cert-manager")
    section = text[start:text.index("\n#", start + 1)]
    kinds = set()
    for line in shell_lines(section):
        words = shlex.split(line)
        if words[:2] == ["kubectl", "delete"] or words[:4] == ["kubectl", "-n", NAMESPACE, "delete"]:
            if "app.kubernetes.io/component=certs" in words:
                kinds |= set(words[words.index("delete") + 1].split(","))
    assert kinds == {key[1].lower() for key in dropped}


def test_the_agent_tolerates_gpu_pool_taints_but_not_every_eviction(rendered):
    for folder, objects in rendered.items():
        agent = find(objects, "DaemonSet", "gpushard-agent", NAMESPACE)
        if agent is None:
            continue
        tolerations = tuple(agent["spec"]["template"]["spec"]["tolerations"])
        for taint in (placement.Taint("nvidia.com/gpu", "", "NoSchedule"),
                      placement.Taint("nvidia.com/gpu", "present", "NoSchedule"),
                      placement.Taint("sku", "gpu", "NoSchedule"), placement.Taint("dedicated", "ml", "NoSchedule"),
                      placement.Taint("CriticalAddonsOnly", "true", "NoSchedule")):
            assert placement.tolerates(tolerations, taint), (folder, taint)
        assert not placement.tolerates(tolerations, placement.Taint("maintenance", "", "NoExecute"))


# --- the image -------------------------------------------------------------------------------------

def test_the_image_is_named_in_one_place(rendered):
    for path in DEPLOY.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            if doc.get("kind") == "Kustomization" and doc.get("images"):
                assert path == DEPLOY / "base/kustomization.yaml", f"{path}: a second place that names the image"
            if "kind" in doc and "metadata" in doc:
                for spec in pod_specs(doc):
                    for c in containers(spec):
                        assert c["image"] == "gpushard", f"{path}: {c['name']} names {c['image']!r}"
    (entry,) = yaml.safe_load((DEPLOY / "base/kustomization.yaml").read_text())["images"]
    wanted = f"{entry['newName']}:{entry['newTag']}"
    for folder, objects in rendered.items():
        images = {c["image"] for o in objects for s in pod_specs(o) for c in containers(s)}
        assert images == ({"gpushard:dev"} if folder == "examples/kind" else {wanted}), folder


def _make_image(tmp_path: Path, path: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    env.pop("ENGINE", None)
    return subprocess.run([shutil.which("make"), "-s", "image", *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_make_image_builds_with_the_engine_it_finds(tmp_path, engine):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "args"
    stand_in = bin_dir / engine
    stand_in.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\n")
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    done = _make_image(tmp_path, f"{bin_dir}:/usr/bin:/bin", "IMAGE=registry.example.com/gpushard:0.1.0")
    assert done.returncode == 0, done.stderr
    assert record.read_text().splitlines() == ["build", "--build-arg", f"VERSION={__version__}", "-t",
                                                     "registry.example.com/gpushard:0.1.0", "."]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_image_without_an_engine_says_so(tmp_path):
    done = _make_image(tmp_path, str(tmp_path / "empty"))
    assert done.returncode != 0
    assert "gpushard: make image needs docker or podman" in done.stderr
