"""The values table of docs/helm.md ("Values"), made from the comments of charts/gpushard/values.yaml.

Each value's comment is the lines of `#` right above it; "Lands in:" starts the part that says where the
value goes in the rendered objects. A value is a row when it is not a mapping, or a mapping whose keys have
no comments of their own (resources, nodeSelector): those are a value as a whole.

    python -m tests.chart.valuesdoc              # print the table
    python -m tests.chart.valuesdoc --write FILE # put it between the markers in FILE (make chart-docs)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

VALUES = Path(__file__).resolve().parents[2] / "charts" / "gpushard" / "values.yaml"
BEGIN = "<!-- values table: made by `make chart-docs` from charts/gpushard/values.yaml; do not edit by hand -->"
END = "<!-- end of the values table -->"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z][A-Za-z0-9_.-]*):(?P<rest>.*)$")


@dataclass(frozen=True)
class Value:
    path: str
    default: object
    what: str
    lands: str


def comments(text: str) -> dict[str, str]:
    """Each key's dotted path -> the comment right above it (empty when none)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = _KEY.match(line)
        if not match:
            if not stripped:
                pending = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([key for _, key in stack] + [match["key"]])
        out[path] = " ".join(pending)
        pending = []
        stack.append((indent, match["key"]))
    return out


def values(text: str | None = None) -> list[Value]:
    text = VALUES.read_text() if text is None else text
    said = comments(text)
    rows: list[Value] = []

    def walk(node: dict, prefix: str) -> None:
        for key, default in node.items():
            path = f"{prefix}{key}"
            children = [f"{path}.{k}" for k in default] if isinstance(default, dict) else []
            if children and any(said.get(child) for child in children):
                walk(default, f"{path}.")
                continue
            what, _, lands = said.get(path, "").partition("Lands in:")
            rows.append(Value(path, default, what.strip(), lands.strip()))

    walk(yaml.safe_load(text), "")
    return rows


def _code(default: object) -> str:
    if default == "":
        return '`""`'
    flow = default if isinstance(default, str) else json.dumps(default, separators=(", ", ": "))
    return "`" + flow.replace("|", "\\|") + "`"


def table(rows: list[Value] | None = None) -> str:
    lines = ["| value | default | what it does | where it lands |", "|---|---|---|---|"]
    for row in rows if rows is not None else values():
        cells = [f"`{row.path}`", _code(row.default), row.what, row.lands]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") if i > 1 else cell for i, cell in enumerate(cells))
                     + " |")
    return "\n".join(lines)


def written(page: str) -> str:
    """The page with its table between the markers made anew."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + table() + "\n" + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="FILE", help="put the table between the markers in FILE")
    args = parser.parse_args(argv)
    if not args.write:
        print(table())
        return 0
    path = Path(args.write)
    path.write_text(written(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
