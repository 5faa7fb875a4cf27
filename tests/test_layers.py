"""We test that the layering of DESIGN.md holds, by scanning every module's imports:
- webhook.core imports only the standard library (and itself);
- webhook.settings imports only the core and libraries;
- the admission server, the agent and the cluster views never import each other, nor the CLI;
- nothing but the CLI imports the CLI.
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
    "webhook.certificates": ("webhook.admission", "webhook.agent", "webhook.cluster", "webhook.cli"),
    "webhook.relocation": ("webhook.admission", "webhook.agent", "webhook.cli"),
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
