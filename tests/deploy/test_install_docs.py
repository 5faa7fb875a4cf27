"""docs/install.md and the examples it walks through say what the repository does.

We test:
- every deploy/ and examples/ path the page names exists, and every `kubectl apply -k` target
  is a kustomization;
- every `gpushard` command line on the page parses with the real parser;
- the example pod and Deployment are admitted by the same decision the webhook makes, as
  shares of one card, and the example quota limits the shares resource of names.py;
- the page says plainly that the test suite does not run the kind example.
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


def test_named_paths_exist():
    paths = set(re.findall(r"\b((?:deploy|examples|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_])", PAGE))
    assert paths
    for path in paths:
        assert (ROOT / path).exists(), path
    for target in re.findall(r"kubectl (?:apply|delete) -k (\S+)", PAGE):
        assert (ROOT / target / "kustomization.yaml").is_file(), target


def test_gpushard_command_lines_parse():
    blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", PAGE, flags=re.S))
    lines = re.findall(r"^\s*(gpushard [^\n#]*)", blocks, flags=re.M)
    lines += re.findall(r"`(gpushard [^`]*)`", PAGE)
    commands = {line.strip() for line in lines}
    assert any("certs --install" in c for c in commands)
    for command in commands:
        words = shlex.split(command)[1:]
        try:
            cli.build_parser().parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"docs/install.md: `{command}` does not parse ({exc.code})")


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
