"""We test that the layering of docs/development.md holds, by scanning every module's imports:
- webhook.core imports only the standard library (and itself);
- webhook.settings imports only the core and libraries;
- the admission server, the agent and the cluster views never import each other, nor the CLI;
- nothing but the CLI imports the CLI;
- the commands (audit and status, review, install, top, replace, serve, agent, cordon) never import each other;
- the agent's rooms: its two backends never import each other, and the node's own pieces import neither;
- only the modules named in KUBERNETES_CLIENTS import the kubernetes client library.
"""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "webhook"
STDLIB = set(sys.stdlib_module_names)

# package -> webhook packages it must never import
FORBIDDEN = {
    "webhook.settings": ("webhook.admission", "webhook.agent", "webhook.cluster", "webhook.cli"),
    "webhook.admission": ("webhook.agent", "webhook.cli"),
    "webhook.agent": ("webhook.admission", "webhook.cluster", "webhook.cli"),
    "webhook.cluster": ("webhook.admission", "webhook.agent", "webhook.cli"),
    # The API plumbing: imported by every adapter, it imports none of them.
    "webhook.kubeapi": ("webhook.admission", "webhook.agent", "webhook.cluster", "webhook.cli", "webhook.replacement",
                        "webhook.auditing", "webhook.reviewing", "webhook.installing", "webhook.top",
                        "webhook.cordoning"),
    "webhook.certificates": ("webhook.admission", "webhook.agent", "webhook.cluster", "webhook.cli"),
    "webhook.replacement": ("webhook.admission", "webhook.agent", "webhook.cli"),
    # The agent's rooms (webhook/agent/__init__.py): the two backends never meet; the node's own pieces stand
    # under both and under the metrics.
    "webhook.agent.node": ("webhook.agent.deviceplugin", "webhook.agent.dra", "webhook.agent.metrics",
                           "webhook.agent.running"),
    "webhook.agent.deviceplugin": ("webhook.agent.dra", "webhook.agent.metrics", "webhook.agent.running"),
    "webhook.agent.dra": ("webhook.agent.deviceplugin", "webhook.agent.metrics", "webhook.agent.running"),
    "webhook.agent.metrics": ("webhook.agent.deviceplugin", "webhook.agent.dra", "webhook.agent.running"),
}

# The modules (or packages) behind the commands of webhook.cli: each stands on its own.
COMMANDS = ("webhook.auditing", "webhook.reviewing", "webhook.installing", "webhook.top", "webhook.replacement",
            "webhook.admission", "webhook.agent", "webhook.cordoning")

# The few modules that talk to the API server through the kubernetes client library; everything
# else reads plain JSON (webhook.core.objects) or goes through webhook.kubeapi.connecting.
KUBERNETES_CLIENTS = {
    "webhook.kubeapi.connecting", "webhook.kubeapi.informing", "webhook.cluster.kube", "webhook.cluster.templates",
    "webhook.cluster.deviceclasses", "webhook.cluster.peers",
    "webhook.auditing", "webhook.cordoning",
    "webhook.installing", "webhook.top", "webhook.replacement.controller", "webhook.kubeapi.lease",
    "webhook.authorizing", "webhook.agent.node.otherdrivers", "webhook.agent.node.cordonwatching",
    "webhook.agent.dra.backend", "webhook.agent.dra.kubeletplugin",
    "webhook.agent.dra.slices", "webhook.agent.dra.nodecount", "webhook.agent.metrics.podlisting",
    "webhook.agent.node.publishing", "webhook.agent.node.startuptaint",
    "webhook.agent.dra.runtimechecking",
}


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if "proto" in rel.parts and name.endswith("_pb2") or name.endswith("_pb2_grpc"):
            continue
        yield name, path


def imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            for alias in node.names:
                yield f"{node.module}.{alias.name}"


ALL = list(modules())


@pytest.mark.parametrize("name, path", [m for m in ALL if m[0].startswith("webhook.core")])
def test_core_imports_only_the_standard_library(name, path):
    for imported in imports(path):
        top = imported.split(".")[0]
        assert top in STDLIB or imported.startswith("webhook.core") or imported == "webhook", (
            f"{name} imports {imported}")


@pytest.mark.parametrize("name, path", ALL)
def test_adapters_stay_ignorant_of_each_other(name, path):
    for prefix, banned in FORBIDDEN.items():
        if name == prefix or name.startswith(prefix + "."):
            for imported in imports(path):
                assert not imported.startswith(banned), f"{name} imports {imported}"
    if name != "webhook.cli":
        assert not any(i.startswith("webhook.cli") for i in imports(path)), f"{name} imports the CLI"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("name, path", [m for m in ALL if any(_within(m[0], c) for c in COMMANDS)])
def test_commands_stay_ignorant_of_each_other(name, path):
    own = next(c for c in COMMANDS if _within(name, c))
    for imported in imports(path):
        other = next((c for c in COMMANDS if c != own and _within(imported, c)), None)
        assert other is None, f"{name} (command {own}) imports {imported}, of command {other}"


@pytest.mark.parametrize("name, path", ALL)
def test_only_the_named_modules_import_the_kubernetes_client(name, path):
    uses = any(i == "kubernetes" or i.startswith("kubernetes.") for i in imports(path))
    assert not uses or name in KUBERNETES_CLIENTS, f"{name} imports kubernetes but is not in KUBERNETES_CLIENTS"


def test_every_named_kubernetes_client_exists():
    assert KUBERNETES_CLIENTS <= {name for name, _path in ALL}
