"""The README and the command line's reference page (docs/cli.md) say what the code does.

We test:
- the two-command quick start (`make demo`, `make test`) is in the README, as one block of its own;
- docs/cli.md's kubectl flag table: every flag row exists, with its short and long names and its output
  formats, on every command it names, and every kubectl flag of those commands is in the table;
- docs/cli.md's exit-code table is webhook.kubectlflags.EXIT_CODES, code for code and word for word;
- GPUSHARD_FRACTION, which gpushard writes into every GPU container, is explained in the README.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from webhook import cli, kubectlflags

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CLI_PAGE = (ROOT / "docs" / "cli.md").read_text()
# Flags of the commands that are theirs alone, documented with each command, not kubectl's.
OWN = {"-h", "--help", "--config", "--debug", "-f", "--filename", "--cluster", "--mode"}


def table_after(heading: str, text: str = CLI_PAGE) -> list[list[str]]:
    start = text.index(f"\n{heading}\n")
    rows = []
    for line in text[start + 1:].splitlines()[1:]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not set("".join(cells)) <= set("-"):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # the header row


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_plugin_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_quick_start_is_in_the_readme():
    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    assert [["make demo", "make test"] == [line.split("#")[0].strip() for line in block.splitlines()]
            for block in blocks].count(True) == 1


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def test_every_flag_in_the_table_is_on_every_command_it_names():
    commands = subcommands()
    rows = table_after("## As a kubectl plugin")
    assert len(rows) >= 8
    documented: dict[str, set[str]] = {}
    for flag, _what, names in rows:
        flag = flag.strip("`").replace("\\|", "|")
        spelled, _, values = flag.partition(" ")
        strings = spelled.split(",") if "," not in flag else [s.strip().split(" ")[0] for s in flag.split(",")]
        for name in (n.strip() for n in names.split(",")):
            if name not in commands:
                # `top` comes with its own module; where it is absent there is nothing to check.
                assert name == "top", f"docs/cli.md names a command the plugin lacks: {name}"
                continue
            options = _options(commands[name])
            for string in strings:
                assert string in options, f"{name} has no {string}"
                documented.setdefault(name, set()).add(string)
            if strings[0] == "-o":
                claimed = set(flag.split(" ", 2)[-1].split("|"))
                assert set(options["-o"].choices) - {kubectlflags.TABLE} == claimed, name
    for name, parser in commands.items():
        undocumented = set(_options(parser)) - OWN - documented.get(name, set())
        assert not undocumented, f"{name}: flags missing from the table of docs/cli.md: {sorted(undocumented)}"


def test_the_exit_code_table_is_the_code():
    rows = table_after("## Exit codes")
    assert [(int(code), text) for code, text in rows] == list(kubectlflags.EXIT_CODES)


@pytest.mark.parametrize("name", ["GPUSHARD_FRACTION"])
def test_written_env_is_explained(name):
    assert f"`{name}` is for the program in the container" in README
