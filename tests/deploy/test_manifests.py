"""The install manifests: valid Kubernetes objects whose pieces agree with each other and with the code.

We test:
- every kustomization (deploy/base, each overlay, examples/kind) renders, and every object
  validates strictly against the schema of the oldest supported Kubernetes (1.30) and of the
  newest one kubernetes-validate knows; cert-manager objects have the fields they need;
- every file in deploy/ is read by some kustomization, and every example manifest validates;
- the webhook's pieces agree: Service port -> targetPort == containerPort == `serve --bind`
  port; the Service is what both webhooks call, at /mutate and /audit; the certificate is
  made for that Service and lands in the Secret the Deployment mounts; the config path is the
  ConfigMap's key; every container's args parse with the real `gpushard` parser;
- the webhook configuration: failure policies (enforce namespaces: Fail for what asks a GPU or names a
  device, Ignore for the rest), the namespace label and values of webhook/core/names.py, its own
  namespace excluded from every entry, rules for pods and exactly
  the template kinds the code rewrites, sideEffects None, short timeout, IfNeeded, Equivalent;
- the ConfigMap's config loads with webhook.settings and names the resources of names.py;
- the webhook pod is "restricted", probes /readyz and /healthz over HTTPS, mounts the Secret
  as a folder, has /tmp writable, two replicas spread over nodes and a PDB of minAvailable 1;
- the agent: shared nodes only, the kubelet folders it uses and no others, NODE_NAME from the
  downward API, every card visible through the NVIDIA runtime (by env and by a device-list
  mount, so also on nodes whose toolkit ignores the env), node-critical priority;
- the overlays: cert-manager injects the CA of a Certificate for the same Service and Secret
  and drops the certs Job; audit-only keeps only the audit webhook and runs no agent;
- every gpushard.io name in deploy/ and examples/ is one names.py knows (or the node label
  that only the operator sets).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.agent import toolkit
from tests.deploy import rendering
from webhook import cli, settings
from webhook.core import names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
KUSTOMIZATIONS = sorted({p.parent for p in DEPLOY.rglob("kustomization.yaml")} | {ROOT / "examples/kind"})
OLDEST, NEWEST = "1.30", kubernetes_validate.utils.latest_version()
# The dra overlay's own objects (resource.k8s.io/v1 with consumable capacity) need 1.36 (docs/dra.md).
DRA_OLDEST = "1.36"
NAMESPACE = "gpushard-system"
# Chosen by the operator to say "this node shares its GPUs" (docs/install.md); the code never
# reads it, so it is not in names.py.
SHARED_NODE_LABEL = "gpushard.io/shared-node"
# Required fields of the cert-manager objects (no schema for them ships with kubernetes-validate).
CERT_MANAGER_REQUIRED = {"Issuer": (), "Certificate": ("secretName", "issuerRef")}
# The same for the Prometheus operator's monitors (tests/deploy/test_monitoring.py checks them closely).
MONITOR_REQUIRED = {"PodMonitor": ("selector", "podMetricsEndpoints"), "ServiceMonitor": ("selector", "endpoints"),
                    "PrometheusRule": ("groups",)}


def _find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def _args(container: dict) -> argparse.Namespace:
    return cli.build_parser().parse_args(container.get("args", []))


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return rendering.render(BASE)


def _webhook_pod(objects: list[dict]) -> dict:
    return _find(objects, "Deployment", "gpushard-webhook")["spec"]["template"]["spec"]


def _agent_pod(objects: list[dict]) -> dict:
    return _find(objects, "DaemonSet", "gpushard-agent")["spec"]["template"]["spec"]


def _validate(obj: dict, where: str) -> None:
    if obj["apiVersion"].startswith("cert-manager.io/"):
        for field in CERT_MANAGER_REQUIRED[obj["kind"]]:
            assert field in obj["spec"], f"{where}: {obj['kind']} needs spec.{field}"
        return
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        for field in MONITOR_REQUIRED[obj["kind"]]:
            assert field in obj["spec"], f"{where}: {obj['kind']} needs spec.{field}"
        return
    for version in (DRA_OLDEST if obj["apiVersion"] == "resource.k8s.io/v1" else OLDEST, NEWEST):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.utils.ValidationError as exc:
            pytest.fail(f"{where}: {obj['kind']}/{obj['metadata'].get('name')} is invalid in Kubernetes "
                        f"{version} at {'.'.join(map(str, exc.path))}: {exc.message}")


# --- schema and layout ---------------------------------------------------------------------

@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kustomization_renders_valid_objects(folder):
    objects = rendering.render(folder)
    assert objects
    for obj in objects:
        _validate(obj, str(folder.relative_to(ROOT)))
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                               "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass"):
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']} {obj['metadata']['name']}"


def test_every_file_in_deploy_is_in_a_kustomization():
    listed = set()
    for folder in KUSTOMIZATIONS:
        listed |= rendering.listed_files(folder)
    on_disk = {p.resolve() for p in DEPLOY.rglob("*") if p.is_file()}
    assert sorted(on_disk - listed) == []


EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.name != "cluster.yaml"], ids=lambda p: p.name)
def test_example_manifests_validate(path):
    for obj in rendering.load_documents(path):
        _validate(obj, path.name)


def test_kind_script_parses():
    import subprocess

    result = subprocess.run(["bash", "-n", str(ROOT / "examples/kind/run.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- the pieces agree ----------------------------------------------------------------------

def test_ports_agree(base):
    service = _find(base, "Service", "gpushard")
    (port,) = service["spec"]["ports"]
    (container,) = _webhook_pod(base)["containers"]
    (container_port,) = container["ports"]
    bind_port = int(_args(container).bind.rpartition(":")[2])
    assert port["targetPort"] == container_port["containerPort"] == bind_port == 8443
    assert port["port"] == 443
    # The Service selects exactly the webhook's pods.
    assert service["spec"]["selector"].items() <= \
        _find(base, "Deployment", "gpushard-webhook")["spec"]["template"]["metadata"]["labels"].items()
    for hook in _find(base, "MutatingWebhookConfiguration")["webhooks"]:
        ref = hook["clientConfig"]["service"]
        assert (ref["name"], ref["namespace"], ref["port"]) == ("gpushard", NAMESPACE, port["port"])
        assert "caBundle" not in hook["clientConfig"], "the certs Job or cert-manager fills it in"


def test_certificate_service_and_secret_agree(base):
    job_args = _args(_find(base, "Job", "gpushard-certs")["spec"]["template"]["spec"]["containers"][0])
    cron = _find(base, "CronJob", "gpushard-certs-renew")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert _args(cron["containers"][0]) == job_args
    assert job_args.install and job_args.days > job_args.renew_before
    assert (job_args.service, job_args.namespace) == ("gpushard", NAMESPACE)
    assert job_args.webhook_config == _find(base, "MutatingWebhookConfiguration")["metadata"]["name"]
    pod = _webhook_pod(base)
    container = pod["containers"][0]
    serve = _args(container)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in (serve.cert, serve.key):
        folder, _, key = path.rpartition("/")
        mount = mounts[folder]
        assert "subPath" not in mount, "a subPath mount never sees a renewed Secret"
        assert volumes[mount["name"]]["secret"]["secretName"] == job_args.secret
        assert key in ("tls.crt", "tls.key")
    folder, _, key = serve.config.rpartition("/")
    config_map = volumes[mounts[folder]["name"]]["configMap"]["name"]
    assert key in _find(base, "ConfigMap", config_map)["data"]


def test_every_container_command_line_parses(base):
    for folder in KUSTOMIZATIONS:
        for obj in rendering.render(folder):
            for spec in rendering.pod_specs(obj):
                for container in spec["containers"]:
                    assert "command" not in container, "the image's ENTRYPOINT is gpushard"
                    args = _args(container)
                    assert args.command in ("serve", "agent", "certs", "replace")


def test_the_config_map_loads_and_names_the_code_defaults(base):
    config_map = _find(base, "ConfigMap", "gpushard-config")
    loaded = settings.from_mapping(yaml.safe_load(config_map["data"]["config.yaml"]), source="ConfigMap")
    resources = loaded.policy.resources
    assert (resources.fraction, resources.shares, resources.card_prefix) == \
        (names.FRACTION_RESOURCE, names.SHARES_RESOURCE, names.CARD_PREFIX)
    # The webhook and the agent read the same file.
    assert _args(_webhook_pod(base)["containers"][0]).config == _args(_agent_pod(base)["containers"][0]).config


# --- the webhook configuration -------------------------------------------------------------

def test_webhooks_by_mode(base):
    hooks = {h["name"]: h for h in _find(base, "MutatingWebhookConfiguration")["webhooks"]}
    assert set(hooks) == {"enforce.gpushard.io", "hide.gpushard.io", "audit.gpushard.io"}
    # Enforce namespaces have two entries, split by matchConditions (tests/deploy/test_webhook_conditions.py).
    for name, mode, path, failure in (("enforce.gpushard.io", names.MODE_ENFORCE, "/mutate", "Fail"),
                                      ("hide.gpushard.io", names.MODE_ENFORCE, "/mutate", "Ignore"),
                                      ("audit.gpushard.io", names.MODE_AUDIT, "/audit", "Ignore")):
        hook = hooks[name]
        assert hook["clientConfig"]["service"]["path"] == path
        assert hook["failurePolicy"] == failure
        expressions = hook["namespaceSelector"]["matchExpressions"]
        assert {"key": names.MODE_LABEL, "operator": "In", "values": [mode]} in expressions
        assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE]} in expressions
        assert "matchLabels" not in hook["namespaceSelector"]
        assert hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert 1 <= hook["timeoutSeconds"] <= 5
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["matchPolicy"] == "Equivalent"


def test_rules_cover_pods_and_exactly_the_template_kinds(base):
    plural = {"Deployment": "apps/deployments", "StatefulSet": "apps/statefulsets", "DaemonSet": "apps/daemonsets",
              "ReplicaSet": "apps/replicasets", "Job": "batch/jobs", "CronJob": "batch/cronjobs",
              "ReplicationController": "/replicationcontrollers", "PodTemplate": "/podtemplates"}
    assert set(plural) == set(names.TEMPLATE_PATHS)
    versions = {"": "v1", "apps": "v1", "batch": "v1"}
    for hook in _find(base, "MutatingWebhookConfiguration")["webhooks"]:
        covered: dict[str, set[str]] = {}
        for rule in hook["rules"]:
            assert rule["scope"] == "Namespaced"
            for group in rule["apiGroups"]:
                assert rule["apiVersions"] == [versions[group]]
                for resource in rule["resources"]:
                    covered.setdefault(f"{group}/{resource}", set()).update(rule["operations"])
        expected = {name: {"CREATE", "UPDATE"} for name in plural.values()}
        expected["/pods"] = {"CREATE"}
        expected["/pods/ephemeralcontainers"] = {"UPDATE"}
        assert covered == expected, hook["name"]


def test_the_webhook_namespace_never_opts_in(base):
    labels = _find(base, "Namespace", NAMESPACE)["metadata"].get("labels", {})
    assert names.MODE_LABEL not in labels


# --- the webhook pod -----------------------------------------------------------------------

def test_webhook_pod_is_restricted_and_probed_over_https(base):
    deployment = _find(base, "Deployment", "gpushard-webhook")
    assert deployment["spec"]["replicas"] == 2
    pod = _webhook_pod(base)
    assert pod["serviceAccountName"] == "gpushard-webhook"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
    assert "privileged" not in sc or sc["privileged"] is False
    port = container["ports"][0]
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["scheme"]) == (path, "HTTPS")
        assert get["port"] in (port["name"], port["containerPort"])
    assert container["resources"]["requests"] and container["resources"]["limits"]
    tmp = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/tmp"]
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[tmp]
    spread = pod["topologySpreadConstraints"]
    assert any(c["topologyKey"] == "kubernetes.io/hostname" and c["whenUnsatisfiable"] == "DoNotSchedule"
               for c in spread)
    assert all(c["labelSelector"]["matchLabels"].items() <= deployment["spec"]["selector"]["matchLabels"].items()
               for c in spread)


def test_pdb_keeps_one_webhook(base):
    pdb = _find(base, "PodDisruptionBudget", "gpushard-webhook")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == _find(base, "Deployment", "gpushard-webhook")["spec"]["selector"]


# --- the agent -----------------------------------------------------------------------------

def test_agent_runs_on_shared_nodes_and_sees_every_card(base):
    pod = _agent_pod(base)
    assert pod["serviceAccountName"] == "gpushard-agent"
    assert pod["nodeSelector"] == {SHARED_NODE_LABEL: "true"}
    # Any NoSchedule taint of a GPU pool (test_rendered.py checks the names GPU pools use).
    assert {"operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["runtimeClassName"] == "nvidia"
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}
    assert env[names.VISIBLE_DEVICES_ENV]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    sc = container["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc.get("privileged") is not True


def test_the_node_policy_binds_the_agent_account(base):
    policy = _find(base, "ValidatingAdmissionPolicy", "gpushard-agent-own-node")
    (condition,) = policy["spec"]["matchConditions"]
    account = _agent_pod(base)["serviceAccountName"]
    assert condition["expression"] == f'request.userInfo.username == "system:serviceaccount:{NAMESPACE}:{account}"'
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["nodes"]
    binding = _find(base, "ValidatingAdmissionPolicyBinding", "gpushard-agent-own-node")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_agent_mounts_exactly_the_kubelet_folders_it_uses(base):
    from webhook.agent.deviceplugin import registration

    pod = _agent_pod(base)
    container = pod["containers"][0]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounted = {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host}
    args = _args(container)
    assert args.device_plugin_dir == registration.DEVICE_PLUGIN_DIR
    assert mounted.get(args.device_plugin_dir) == registration.DEVICE_PLUGIN_DIR
    # The pod-resources socket only where the agent's code asks the kubelet about pods.
    source = "\n".join(p.read_text() for p in (ROOT / "webhook/agent").rglob("*.py"))
    wanted = {registration.DEVICE_PLUGIN_DIR}
    if "pod-resources" in source:
        wanted.add("/var/lib/kubelet/pod-resources")
    # The host's /proc, read-only, where the metrics read GPU processes' cgroups (instead of hostPID).
    if args.metrics_port:
        from webhook.agent.node import podresources

        wanted.add("/proc")
        assert mounted[args.proc_root] == "/proc"
        assert os.path.dirname(args.pod_resources_socket) == "/var/lib/kubelet/pod-resources"
        assert os.path.dirname(podresources.SOCKET) == "/var/lib/kubelet/pod-resources"
        read_only = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
        assert {args.proc_root, "/var/lib/kubelet/pod-resources"} <= read_only
        assert not pod.get("hostPID")
    # NVIDIA's container toolkit config, read-only: each file the agent judges is in a folder mounted from the
    # host folder the toolkit reads, the GPU Operator's and a hand install's, in that order.
    from webhook.agent.node import toolkitcheck

    read_only = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
    assert len(args.toolkit_config) == len(toolkitcheck.CONFIG_PATHS)
    for inside, on_host in zip(args.toolkit_config, toolkitcheck.CONFIG_PATHS, strict=True):
        folder = os.path.dirname(inside)
        assert folder in read_only and mounted[folder] == os.path.dirname(on_host), (inside, on_host)
        assert os.path.basename(inside) == os.path.basename(on_host)
        wanted.add(os.path.dirname(on_host))
    assert set(mounted.values()) - {"/dev/null"} == wanted
    # The one other host path: /dev/null as the device-list request for every card.
    assert {p for p, h in mounted.items() if h == "/dev/null"} == {names.DEVICE_LIST_MOUNT_ROOT + "/all"}


@pytest.mark.parametrize("node", [toolkit.DEFAULT_NODE, toolkit.HARDENED_NODE], ids=["default", "hardened"])
def test_the_agent_sees_every_card_on_both_kinds_of_node(base, node):
    pod = _agent_pod(base)
    (container,) = pod["containers"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    seen = toolkit.container([], own_env={e["name"]: e.get("value") for e in container["env"] if "value" in e})
    seen.mounts = [(host[m["name"]], m["mountPath"]) for m in container["volumeMounts"] if m["name"] in host]
    cards = [(0, "GPU-a"), (1, "GPU-b")]
    assert toolkit.visible_cards(seen, node, cards) == {"GPU-a", "GPU-b"}


def test_agent_serves_metrics_on_its_named_port(base):
    container = _agent_pod(base)["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == _args(container).metrics_port


# --- overlays ------------------------------------------------------------------------------

def test_cert_manager_overlay_injects_the_ca_of_the_serving_certificate(base):
    objects = rendering.render(DEPLOY / "overlays/cert-manager")
    config = _find(objects, "MutatingWebhookConfiguration")
    namespace, _, name = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].partition("/")
    certificate = _find(objects, "Certificate", name)
    assert certificate["metadata"]["namespace"] == namespace == NAMESPACE
    assert f"gpushard.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    secret = _find(objects, "Deployment", "gpushard-webhook")["spec"]["template"]["spec"]["volumes"]
    assert certificate["spec"]["secretName"] in [v["secret"]["secretName"] for v in secret if "secret" in v]
    issuer = certificate["spec"]["issuerRef"]["name"]
    assert _find(objects, issuer and "Issuer", issuer)
    assert not [o for o in objects if o["metadata"]["name"].startswith("gpushard-certs")]
    # Everything else is the base, unchanged.
    kept = [o for o in base if not o["metadata"]["name"].startswith("gpushard-certs")]
    assert [o for o in objects if o["kind"] not in ("Issuer", "Certificate", "MutatingWebhookConfiguration")] == \
        [o for o in kept if o["kind"] != "MutatingWebhookConfiguration"]


def test_audit_only_overlay_keeps_only_the_audit_webhook(base):
    objects = rendering.render(DEPLOY / "overlays/audit-only")
    hooks = _find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert [h["name"] for h in hooks] == ["audit.gpushard.io"]
    assert hooks[0]["failurePolicy"] == "Ignore"
    # and no agent: NVIDIA's device plugin keeps serving the GPUs in audit mode.
    assert not [o for o in objects if o["kind"] == "DaemonSet"]
    assert not [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "gpushard-replacer"]


def test_isolation_mps_overlay_configures_both_and_gives_the_agent_its_folders(base):
    objects = rendering.render(DEPLOY / "overlays/isolation-mps")
    config_map = _find(objects, "ConfigMap", "gpushard-config")
    assert settings.from_mapping(yaml.safe_load(config_map["data"]["config.yaml"])).policy.isolation == "mps"
    pod = _agent_pod(objects)
    agent = pod["containers"][0]
    assert _args(agent).mps_root == "/run/gpushard/mps"
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host[mounts["/run/gpushard/mps"]] == "/run/gpushard/mps"  # host paths in Allocate hold inside too
    assert host[mounts["/dev/shm"]] == "/run/gpushard/mps/shm"


def test_kind_overlay_runs_the_agent_on_the_fake_inventory():
    from webhook.agent.node import nvml

    objects = rendering.render(ROOT / "examples/kind")
    pod = _agent_pod(objects)
    assert "runtimeClassName" not in pod
    args = _args(pod["containers"][0])
    folder, _, key = args.fake_inventory.rpartition("/")
    mount = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}[folder]
    config_map = {v["name"]: v for v in pod["volumes"]}[mount]["configMap"]["name"]
    inventory = _find(objects, "ConfigMap", config_map)["data"][key]
    assert len(nvml.parse_inventory(yaml.safe_load(inventory), "inventory")) == 2
    images = {c["image"] for o in objects for s in rendering.pod_specs(o) for c in s["containers"]}
    assert images == {"gpushard:dev"}
    nodes = yaml.safe_load((ROOT / "examples/kind/kind-cluster.yaml").read_text())["nodes"]
    assert [n.get("labels", {}).get(SHARED_NODE_LABEL) for n in nodes] == [None, "true", "true"]


def test_the_kind_script_builds_the_image_the_overlay_uses():
    script = (ROOT / "examples/kind/run.sh").read_text()
    assert 'IMAGE="gpushard:dev"' in script
    assert "kubectl" in script and "apply -k examples/kind" in script
    words = shlex.split(script.split("docker build", 1)[1].splitlines()[0])
    assert words == ["-t", "$IMAGE", "."]


# --- names ---------------------------------------------------------------------------------

def test_every_gpushard_name_is_known_to_the_code():
    known = {value for key, value in vars(names).items() if key.isupper() and isinstance(value, str)}
    known.add(SHARED_NODE_LABEL)
    pattern = re.compile(r"gpushard\.io/[A-Za-z0-9][-A-Za-z0-9_.]*")
    files = [p for p in list(DEPLOY.rglob("*.yaml")) + EXAMPLES + list((ROOT / "examples/kind").glob("*"))
             if p.name != "cluster.yaml"]
    for path in files:
        for found in pattern.findall(path.read_text()):
            if found.startswith(names.CARD_PREFIX):
                continue
            assert found in known, f"{path.relative_to(ROOT)}: {found} is not in webhook/core/names.py"


def test_the_replacer_runs_a_standby_and_a_liveness_probe_on_its_loop(base):
    deployment = _find(base, "Deployment", "gpushard-replacer")
    assert deployment["spec"]["replicas"] == 2  # one leads by the Lease, the other stands by
    pod = deployment["spec"]["template"]["spec"]
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (container,) = pod["containers"]
    args = _args(container)
    assert args.command == "replace" and not args.once
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and ports[probe["port"]] == args.health_port
    # The probe fails only after the loop has stalled for longer than any call may take.
    assert args.stall_seconds > 3 * 30 and args.request_timeout == "30s"
