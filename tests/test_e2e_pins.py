"""The pins of make e2e's real components: e2e/versions.env and the Go modules written from it agree.

We test:
- every Kubernetes minor pinned has its module, which builds that release's commands, requires
  k8s.io/kubernetes at the pinned version and replaces every staging module with the same release
  (v0.<minor>.<patch>), so a build never mixes releases;
- the fake CRI's and containerd's modules require the pinned versions, and every module has a go.sum
  (the checksums the build verifies against) naming them;
- the chart's kubeVersion admits every pinned minor and no older one, and docs/compatibility.md's
  table names each pinned release;
- e2e/build.py reads versions.env as make does, refuses a malformed line naming it, and puts each
  component in a folder named by its version, outside the work tree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e"))
import build  # noqa: E402

PINS = build.pins()
MINORS = build.kubernetes_minors(PINS)


def requires(go_mod: str) -> dict[str, str]:
    found = {}
    for line in go_mod.splitlines():
        line = line.split("//", 1)[0].strip().removeprefix("require ").strip()
        m = re.fullmatch(r"([\w./-]+) (v[\w.+-]+)", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def replaces(go_mod: str) -> dict[str, str]:
    return dict(re.findall(r"^\s*(?:replace\s+)?([\w./-]+) => [\w./-]+ (v\S+)$", go_mod, flags=re.M))


def test_four_supported_minors_are_pinned_with_a_default_among_them():
    assert sorted(MINORS) == ["1.34", "1.35", "1.36", "1.37"]
    assert PINS["KUBERNETES_DEFAULT"] in MINORS
    for minor, version in MINORS.items():
        assert re.fullmatch(rf"v{re.escape(minor)}\.\d+", version), (minor, version)


@pytest.mark.parametrize("minor", sorted(MINORS))
def test_a_kubernetes_module_builds_one_release(minor):
    folder = ROOT / "e2e" / "kubernetes" / minor
    go_mod = (folder / "go.mod").read_text()
    version = MINORS[minor]
    staging = "v0" + version.removeprefix("v1")
    assert requires(go_mod)["k8s.io/kubernetes"] == version
    tools = re.search(r"^tool \((.*?)^\)", go_mod, flags=re.M | re.S).group(1).split()
    assert sorted(tools) == sorted(f"k8s.io/kubernetes/cmd/{c}" for c in build.KUBERNETES_COMMANDS)
    replaced = replaces(go_mod)
    assert len(replaced) >= 31, replaced
    assert set(replaced.values()) == {staging}, replaced
    # Every k8s.io module the build requires at v0.0.0 (kubernetes' own placeholder) is replaced.
    placeholders = {m for m, v in requires(go_mod).items() if v == "v0.0.0"}
    assert placeholders <= set(replaced), placeholders - set(replaced)
    go_sum = (folder / "go.sum").read_text()
    assert f"k8s.io/kubernetes {version} h1:" in go_sum
    assert f"k8s.io/api {staging} h1:" in go_sum


def test_the_fake_cri_and_containerd_modules_require_their_pins():
    fakecri = (ROOT / "e2e" / "fakecri" / "go.mod").read_text()
    assert requires(fakecri)["k8s.io/cri-client"] == PINS["CRI_CLIENT"]
    assert f"k8s.io/cri-client {PINS['CRI_CLIENT']} h1:" in (ROOT / "e2e" / "fakecri" / "go.sum").read_text()
    containerd = (ROOT / "e2e" / "containerd" / "go.mod").read_text()
    assert requires(containerd)["github.com/containerd/containerd/v2"] == PINS["CONTAINERD_2"]
    assert "-" not in PINS["CONTAINERD_2"], "a release, not a beta or rc"
    assert (f"github.com/containerd/containerd/v2 {PINS['CONTAINERD_2']} h1:"
            in (ROOT / "e2e" / "containerd" / "go.sum").read_text())


@pytest.mark.parametrize(("folder", "module", "pin"), [
    ("nvidia-device-plugin", build.NVIDIA_PLUGIN_MODULE, "NVIDIA_DEVICE_PLUGIN"),
    ("nvidia-container-toolkit", build.NVIDIA_TOOLKIT_MODULE, "NVIDIA_CONTAINER_TOOLKIT")])
def test_nvidias_modules_require_their_pins_and_build_their_commands(folder, module, pin):
    go_mod = (ROOT / "e2e" / folder / "go.mod").read_text()
    assert requires(go_mod)[module] == PINS[pin]
    assert "-" not in PINS[pin], "a release, not a beta or rc"
    assert f"{module} {PINS[pin]} h1:" in (ROOT / "e2e" / folder / "go.sum").read_text()
    commands = build.NVIDIA_PLUGIN_COMMANDS if folder == "nvidia-device-plugin" else build.NVIDIA_TOOLKIT_COMMANDS
    tools = re.findall(rf"^\s*(?:tool\s+)?({re.escape(module)}/cmd/\S+)$", go_mod, flags=re.M)
    assert sorted(tools) == sorted(f"{module}/cmd/{c}" for c in commands)
    assert "replace" not in go_mod


@pytest.mark.parametrize(("folder", "module", "tool", "pin"), [
    ("karpenter", build.KARPENTER_MODULE, "sigs.k8s.io/karpenter/kwok", "KARPENTER"),
    ("kwok", build.KWOK_MODULE, "sigs.k8s.io/kwok/cmd/kwok", "KWOK"),
    ("kueue", build.KUEUE_MODULE, "sigs.k8s.io/kueue/cmd/kueue", "KUEUE")])
def test_the_peer_modules_require_their_pins_and_build_their_commands(folder, module, tool, pin):
    go_mod = (ROOT / "e2e" / folder / "go.mod").read_text()
    assert requires(go_mod)[module] == PINS[pin]
    assert "-" not in PINS[pin], "a release, not a beta or rc"
    assert f"{module} {PINS[pin]} h1:" in (ROOT / "e2e" / folder / "go.sum").read_text()
    assert re.findall(r"^tool\s+(\S+)$", go_mod, flags=re.M) == [tool]
    assert "replace" not in go_mod


def test_the_generated_go_mod_keeps_upstreams_go_line_and_godebug():
    upstream = ("module k8s.io/kubernetes\n\ngo 1.26.0\n\ngodebug default=go1.26\n\nreplace (\n"
                "\tk8s.io/api => ./staging/src/k8s.io/api\n\tk8s.io/kubelet => ./staging/src/k8s.io/kubelet\n)\n")
    text = build.kubernetes_go_mod("v1.37.2", upstream)
    assert "\ngo 1.26.0\n" in text and "\ngodebug default=go1.26\n" in text
    assert replaces(text) == {"k8s.io/api": "v0.37.2", "k8s.io/kubelet": "v0.37.2"}
    assert requires(text) == {"k8s.io/kubernetes": "v1.37.2"}


def test_the_chart_supports_exactly_the_pinned_minors():
    chart = yaml.safe_load((ROOT / "charts" / "gpushard" / "Chart.yaml").read_text())
    oldest = min(MINORS, key=lambda m: tuple(map(int, m.split("."))))
    assert chart["kubeVersion"] == f">={oldest}.0-0", chart["kubeVersion"]


def test_install_docs_list_what_ran():
    text = (ROOT / "docs" / "compatibility.md").read_text()
    section = text.split("# Compatibility", 1)[1].split("\n## ", 1)[0]
    for version in MINORS.values():
        assert version in section, version


def test_a_malformed_pin_is_refused_naming_the_line(tmp_path, capsys):
    bad = tmp_path / "versions.env"
    bad.write_text("# fine\nKUBERNETES_1_37 = v1.37.2\nkubernetes 1.38\n")
    with pytest.raises(SystemExit):
        build.pins(bad)
    assert "versions.env:3" in capsys.readouterr().err


def test_components_land_outside_the_work_tree_by_version(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSHARD_E2E_CACHE", str(tmp_path))
    paths = build.paths("1.37", PINS)
    assert paths["KUBEBUILDER_ASSETS"] == str(tmp_path / f"kubernetes-{MINORS['1.37']}")
    assert paths["GPUSHARD_E2E_KUBELET"].endswith("/kubelet")
    assert PINS["CRI_CLIENT"] in paths["GPUSHARD_E2E_FAKECRI"]
    assert PINS["CONTAINERD_2"] in paths["GPUSHARD_E2E_CONTAINERD2"]
    assert PINS["NVIDIA_DEVICE_PLUGIN"] in paths["GPUSHARD_E2E_NVIDIA_PLUGIN"]
    assert PINS["NVIDIA_CONTAINER_TOOLKIT"] in paths["GPUSHARD_E2E_NVIDIA_TOOLKIT"]
    assert paths["GPUSHARD_E2E_KARPENTER"] == str(tmp_path / f"karpenter-{PINS['KARPENTER']}")
    assert paths["GPUSHARD_E2E_KWOK"] == str(tmp_path / f"kwok-{PINS['KWOK']}")
    monkeypatch.delenv("GPUSHARD_E2E_CACHE")
    assert ROOT not in Path(build.paths("1.37", PINS)["KUBEBUILDER_ASSETS"]).parents
