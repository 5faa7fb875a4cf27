"""The install pages (docs/install.md, docs/helm.md) and the examples they walk through say what the repository does.

We test:
- every deploy/ and examples/ path the pages name exists, and every `kubectl apply -k` target
  is a kustomization;
- every `gpushard` command line on the pages parses with the real parser;
- the example pod and Deployment are admitted by the same decision the webhook makes, as
  shares of one card, and the example quota limits the shares resource of names.py;
- the page says plainly that the test suite does not run the kind example;
- walked in order, the README's, each install page's and docs/getting-started.md's steps never label or
  use a namespace before a step made it; every `rollout status` has a --timeout; node cleanup selects the
  shared nodes only, and removes the label it selects by last;
- /readyz is described as it behaves (ready after the grace without a view) in docs/troubleshooting.md and
  docs/http.md, and the missing RuntimeClass and policy.runtimeClassName are explained there.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from webhook import cli
from webhook.core import names

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs/install.md").read_text()
HELM_PAGE = (ROOT / "docs/helm.md").read_text()
UPGRADE_PAGE = (ROOT / "docs/upgrade.md").read_text()
# What the paths and command-line checks read: the install pages and the upgrade page.
PAGES = {"docs/install.md": PAGE, "docs/helm.md": HELM_PAGE, "docs/upgrade.md": UPGRADE_PAGE}


def kustomization(page: str, target: str) -> Path:
    """What `kubectl apply -k TARGET` applies: the repository's folder, or, for an overlay of the reader's own
    that the page or docs/install.md shows (a YAML block headed `# TARGET/kustomization.yaml`), deploy/base, which
    it must name."""
    if (ROOT / target / "kustomization.yaml").is_file():
        return ROOT / target
    shown = re.search(rf"```yaml\n# {re.escape(target.rstrip('/'))}/kustomization.yaml\n(.*?)```", page + PAGE,
                      flags=re.S)
    assert shown, f"`kubectl apply -k {target}`: neither a folder of the repository nor an overlay the page shows"
    assert "deploy/base" in yaml.safe_load(shown.group(1))["resources"][0], shown.group(1)
    return ROOT / "deploy" / "base"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_named_paths_exist(name):
    page = PAGES[name]
    paths = set(re.findall(r"\b((?:deploy|examples|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_])", page))
    assert paths
    for path in paths:
        assert (ROOT / path).exists(), f"{name}: {path}"
    for target in re.findall(r"kubectl (?:apply|delete) -k (\S+)", page):
        assert (kustomization(page, target) / "kustomization.yaml").is_file(), f"{name}: {target}"


def test_gpushard_command_lines_parse():
    commands = set()
    for name, page in PAGES.items():
        blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", page, flags=re.S))
        lines = re.findall(r"^\s*(gpushard [^\n#]*)", blocks, flags=re.M)
        lines += re.findall(r"`(gpushard [^`]*)`", page)
        commands |= {(name, line.strip()) for line in lines}
    assert any("certs --install" in c for _, c in commands)
    for name, command in commands:
        words = shlex.split(command)[1:]
        try:
            cli.build_parser().parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"{name}: `{command}` does not parse ({exc.code})")


def test_examples_are_admitted_as_shares_of_one_card(capsys):
    status = cli.main(["review", str(ROOT / "examples/pod-quarter.yaml"), str(ROOT / "examples/deployment-half.yaml")])
    out = capsys.readouterr().out
    assert status == 0, out
    pod, deployment = [d for d in yaml.safe_load_all(out) if d]
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits[names.SHARES_RESOURCE] == "25"
    assert [k for k in limits if k.startswith(names.CARD_PREFIX)] == [names.card_resource(names.CARD_PREFIX, 0)]
    template = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert template == {names.SHARES_RESOURCE: "50"}


def test_quota_example_limits_shares():
    quota = yaml.safe_load((ROOT / "examples/quota.yaml").read_text())
    assert list(quota["spec"]["hard"]) == [f"requests.{names.SHARES_RESOURCE}"]
    namespace = yaml.safe_load((ROOT / "examples/namespace-enforce.yaml").read_text())
    assert quota["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert namespace["metadata"]["labels"][names.MODE_LABEL] == names.MODE_ENFORCE
    # docs/security.md's recommendation: Pod Security baseline at least.
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] in ("baseline", "restricted")


def test_the_kind_example_is_marked_as_not_run_by_the_tests():
    assert "The test suite does not run it" in PAGE


# --- the steps, walked in order ------------------------------------------------------------------

DOCS = {"README.md": (ROOT / "README.md").read_text(), **PAGES,
        "docs/getting-started.md": (ROOT / "docs/getting-started.md").read_text()}


def _commands(text: str) -> list[list[str]]:
    """The kubectl command lines of a document's sh blocks, in order, as words."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("kubectl "):
                try:
                    out.append(shlex.split(line))
                except ValueError:
                    continue  # a quoted argument over several lines (a JSON patch): no namespace or node step
    return out


def _namespaces_made(words: list[str], rendered: dict[str, Path], page: str) -> set[str]:
    """Namespaces a command makes; ``rendered``: files an earlier `kubectl kustomize DIR > FILE` wrote, by name."""
    from tests.deploy import rendering

    if words[1] == "kustomize" and ">" in words:
        rendered[words[words.index(">") + 1]] = ROOT / words[2]
        return set()
    if words[1:3] == ["create", "namespace"]:
        return {words[3]}
    if "apply" in words and "-k" in words:
        target = kustomization(page, words[words.index("-k") + 1])
        return {o["metadata"]["name"] for o in rendering.render(target) if o["kind"] == "Namespace"}
    if "apply" in words and "-f" in words:
        name = words[words.index("-f") + 1]
        if name == "-":
            return set()  # a manifest from the command's standard input (a RuntimeClass): no namespace
        if name in rendered:
            return {o["metadata"]["name"] for o in rendering.render(rendered[name]) if o["kind"] == "Namespace"}
        path = ROOT / name
        return {d["metadata"]["name"] for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "Namespace"}
    return set()


@pytest.mark.parametrize("name", sorted(DOCS))
def test_namespaces_exist_before_they_are_labelled_or_used(name):
    known = {"default", "kube-system"}
    if name == "docs/upgrade.md":
        known.add("gpushard-system")  # the page starts from an install
    rendered: dict[str, Path] = {}
    for words in _commands(DOCS[name]):
        if words[1:3] == ["label", "namespace"] and not words[3].startswith("-"):
            assert words[3] in known, f"{name}: `{' '.join(words)}` labels a namespace nothing has made yet"
        for flag in ("-n", "--namespace"):
            if flag in words and words[1:3] != ["create", "namespace"]:
                used = words[words.index(flag) + 1]
                assert used in known, f"{name}: `{' '.join(words)}` uses a namespace nothing has made yet"
        known |= _namespaces_made(words, rendered, DOCS[name])


def test_rollout_status_always_has_a_timeout():
    texts = {**DOCS, "examples/kind/run.sh": (ROOT / "examples/kind/run.sh").read_text()}
    found = 0
    for name, text in texts.items():
        for line in text.splitlines():
            if "rollout status" in line and re.match(r"\s*(kubectl|k) ", line):
                found += 1
                assert "--timeout" in line, f"{name}: `{line.strip()}` waits for ever on a pod that is never made"
    assert found >= 4


def test_node_cleanup_touches_only_shared_nodes():
    node_commands = [w for w in _commands(UPGRADE_PAGE) if w[1:3] in (["label", "nodes"], ["annotate", "nodes"])]
    assert len(node_commands) == 2
    for words in node_commands:
        assert "--all" not in words and words[3:5] == ["-l", "gpushard.io/shared-node=true"], words
    # The label both select by goes last.
    assert node_commands[0][1] == "annotate" and "gpushard.io/shared-node-" in node_commands[1]


def test_readiness_and_the_runtime_class_are_described_as_they_behave():
    from webhook.admission import app

    grace = f"{app.SYNC_GRACE_S:g} s"
    for name in ("docs/troubleshooting.md", "docs/http.md"):
        text = (ROOT / name).read_text()
        assert "never becomes ready" not in text, name
        around = text[text.index("/readyz"):text.index("/readyz") + 300]
        assert grace in around, f"{name}: /readyz turns ready after {grace} without a view; say so"
    troubleshooting = (ROOT / "docs/troubleshooting.md").read_text()
    assert 'RuntimeClass "nvidia" not found' in troubleshooting and "policy.runtimeClassName" in troubleshooting
