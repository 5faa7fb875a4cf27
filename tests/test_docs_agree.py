"""Every page of the documentation names what the code names.

We test, over README.md and every docs/ page:
- every `gpushard.io/...` name (label, annotation, resource, API version) is one webhook/core/names.py defines
  (a per-card name with its index written as `<k>` or a number), one the manifests in deploy/ write, or the
  reports' API version; a misspelt name fails, naming the page and the name;
- every `gpushard ...` command line in a code block or in backticks parses with the real parser (the placeholders
  the pages write in capitals, such as NODE, are names to the parser too; a command named alone and cli.md's
  synopses with `[...]` are no command lines);
- every config key written `policy.<key>`, `replacement.<key>`, `view.<key>` or `agent.<key>` is a key
  webhook/settings.py accepts.
The flags of the kubectl plugin (tests/test_readme.py), the chart's values table (tests/chart/test_values_table.py)
and the install pages' paths (tests/deploy/test_install_docs.py) are checked where they are written.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

from webhook import cli, settings, top
from webhook.core import names

ROOT = Path(__file__).resolve().parents[1]
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob(
    "*.md"))]}
NAME = re.compile(r"(?<![\w.])gpushard\.io/[A-Za-z0-9<>._-]*")
CARD = re.compile(r"^gpushard\.io/card-(?:\d+|<k>|k|<index>)")


def known_names() -> set[str]:
    found = {v for v in vars(names).values() if isinstance(v, str) and v.startswith("gpushard.io/")}
    found |= {names.CARD_PREFIX + "<k>", names.CARD_MEMORY_LABEL_PREFIX + "<k>" + names.CARD_MEMORY_LABEL_SUFFIX,
              names.CARD_CORDON_ANNOTATION_PREFIX + "<k>" + names.CARD_CORDON_ANNOTATION_SUFFIX, top.API_VERSION}
    for path in (ROOT / "deploy").rglob("*.yaml"):
        found |= set(NAME.findall(path.read_text()))
    return found


KNOWN = known_names()


def normal(name: str) -> str:
    """A name as written on a page, with a card's index as <k> and kubectl's trailing "-" (remove) dropped."""
    name = name.rstrip(".").removesuffix("-")
    return CARD.sub("gpushard.io/card-<k>", name)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_gpushard_name_is_one_the_code_defines(page):
    unknown = set()
    for written in NAME.findall(PAGES[page]):
        name = normal(written)
        # A prefix named as such ("every gpushard.io/ label", "gpushard.io/card-"): a prefix of a known name.
        if name.endswith(("/", "-")) and any(k.startswith(name) for k in KNOWN):
            continue
        if name not in KNOWN:
            unknown.add(written)
    assert not unknown, f"{page} names what no code defines: {sorted(unknown)}"


def command_lines(text: str) -> set[str]:
    blocks = "\n".join(re.findall(r"```(?:sh|console|bash)?\n(.*?)```", text, flags=re.S))
    lines = re.findall(r"^\s*(?:\$ )?(gpushard [^\n#|>]*)", blocks, flags=re.M)
    lines += re.findall(r"`(gpushard [a-z][^`]*)`", text)
    return {line.strip() for line in lines}


def _parses(parser, words: list[str]) -> bool:
    try:
        parser.parse_args(words)
    except SystemExit:
        return False
    return True


def commands(parser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser, command: str) -> set[str]:
    return {s for a in commands(parser)[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_gpushard_command_line_parses(page):
    parser = cli.build_parser()
    known = commands(parser)
    failed = []
    for line in sorted(command_lines(PAGES[page])):
        try:
            words = shlex.split(line)[1:]
        except ValueError:
            continue  # a line cut inside a quote (a sentence's example that goes on)
        if len(words) < 2 or words[0] not in known or "[" in line or "\\|" in line:
            continue  # a command named alone, a synopsis (cli.md's), or prose ("gpushard chooses ...")
        # A flag named with no value ("`gpushard audit -f`") reads as the flag with one; a flag named with its
        # placeholder ("`gpushard serve --cluster FILE`") is a flag of that command.
        if not any(_parses(parser, attempt) for attempt in (words, [*words, "VALUE"])) and not (
                words[1].startswith("-") and {w for w in words[1:] if w.startswith("-")} <= options(parser, words[0])):
            failed.append(line)
    assert not failed, f"{page}: these do not parse: {failed}"


# The chart's own `agent.*` values (its DaemonSet's nodeSelector, resources, ...) share the name of the config's
# agent section.
CHART_AGENT = set(yaml.safe_load((ROOT / "charts/gpushard/values.yaml").read_text())["agent"])
SECTIONS = {"policy": settings.POLICY_KEYS, "replacement": settings.REPLACEMENT_KEYS, "view": settings.VIEW_KEYS,
            "agent": settings.AGENT_KEYS | CHART_AGENT}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_config_key_is_one_the_settings_accept(page):
    unknown = set()
    for section, key in re.findall(r"`(policy|replacement|view|agent)\.([A-Za-z]+)", PAGES[page]):
        if key not in SECTIONS[section]:
            unknown.add(f"{section}.{key}")
    assert not unknown, f"{page} names config keys webhook/settings.py refuses: {sorted(unknown)}"
