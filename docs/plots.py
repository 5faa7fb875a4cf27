"""Draws docs/img/costs.png: what gpushard costs against time-slicing, from the tables of docs/costs.md.

The figures are read from the page itself (its per-size tables: "**100 nodes**" and the table after it),
so the picture is remade from what the page says by one command. The PNG records the figures it drew
(a text chunk, "gpushard-figures"), and tests/test_plots.py checks them against the page.

    make docs-plots           # or: python docs/plots.py, with matplotlib (the docs extra)
"""

from __future__ import annotations

import json
import re
import struct
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "costs.md"
OUT = ROOT / "docs" / "img" / "costs.png"
CHUNK = "gpushard-figures"

# The rows drawn, as the page names them in its "setup" column (one webhook where it says), and their labels.
SETUPS = {
    ("time-slicing (baseline)", "-"): "time-slicing",
    ("gpushard, device plugin", "1"): "gpushard, device plugin",
    ("gpushard, dra", "1"): "gpushard, dra",
}
# Each panel: the column whose header starts so, which number of its cell, the panel's title.
PANELS = (
    ("bound/s", 0, "pods bound a second (more is better)"),
    ("create p50", 0, "a create's p50, ms (less is better)"),
    ("create p50", 1, "a create's p99, ms (less is better)"),
    ("API requests/pod", 0, "API requests per pod (less is better)"),
)
_SIZE = re.compile(r"^\*\*([\d,]+) nodes\*\*")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Row:
    nodes: int
    setup: str
    bound_per_s: float
    create_p50_ms: float
    create_p99_ms: float
    requests_per_pod: float


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _column(header: list[str], starts: str) -> int:
    for i, name in enumerate(header):
        if name.startswith(starts):
            return i
    raise ValueError(f"docs/costs.md: no column starting {starts!r} in {header}")


def _number(cell: str, which: int) -> float:
    numbers = _NUMBER.findall(cell.replace(",", ""))
    if len(numbers) <= which:
        raise ValueError(f"docs/costs.md: no number {which + 1} in {cell!r}")
    return float(numbers[which])


def figures(text: str) -> list[Row]:
    """The drawn rows of each size's table, in the page's order of sizes."""
    rows: list[Row] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        size = _SIZE.match(line)
        if not size:
            continue
        table = []
        for after in lines[i + 1:]:
            if after.startswith("|"):
                table.append(after)
            elif table:
                break
        if not table or not table[0].startswith("| setup |"):
            raise ValueError(f"docs/costs.md: no setup table after {line[:40]!r}")
        header = _cells(table[0])
        setup_at, webhooks_at = _column(header, "setup"), _column(header, "webhooks")
        columns = {starts: _column(header, starts) for starts, _, _ in PANELS}
        found = {}
        for cells in (_cells(r) for r in table[2:]):
            label = SETUPS.get((cells[setup_at], cells[webhooks_at]))
            if label is None:
                continue
            found[label] = Row(
                nodes=int(size.group(1).replace(",", "")), setup=label,
                bound_per_s=_number(cells[columns["bound/s"]], 0),
                create_p50_ms=_number(cells[columns["create p50"]], 0),
                create_p99_ms=_number(cells[columns["create p50"]], 1),
                requests_per_pod=_number(cells[columns["API requests/pod"]], 0))
        missing = [label for label in SETUPS.values() if label not in found]
        if missing:
            raise ValueError(f"docs/costs.md: the {size.group(1)}-node table has no row for {missing}")
        rows += [found[label] for label in SETUPS.values()]
    if not rows:
        raise ValueError("docs/costs.md: no table of a size (a line like **100 nodes**) found")
    return rows


def recorded(png: Path) -> list[Row]:
    """The figures a PNG this script made says it drew (its text chunk), or [] when it has none."""
    data = png.read_bytes()
    at = 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        key, _, value = body.partition(b"\0")
        if kind == b"tEXt" and key.decode("latin-1") == CHUNK:
            return [Row(**r) for r in json.loads(value.decode("latin-1"))]
        if kind == b"zTXt" and key.decode("latin-1") == CHUNK:
            return [Row(**r) for r in json.loads(zlib.decompress(value[1:]).decode("latin-1"))]
        at += 12 + length
    return []


def draw(rows: list[Row], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    sizes = sorted({r.nodes for r in rows})
    labels = list(SETUPS.values())
    colours = {"time-slicing": "#9e9e9e", "gpushard, device plugin": "#3f51b5", "gpushard, dra": "#ff9800"}
    fields = ("bound_per_s", "create_p50_ms", "create_p99_ms", "requests_per_pod")
    figure, axes = pyplot.subplots(2, 2, figsize=(11, 7), dpi=100)
    width = 0.26
    for ax, field, (_, _, title) in zip(axes.flat, fields, PANELS, strict=True):
        for j, label in enumerate(labels):
            values = [next(getattr(r, field) for r in rows if r.nodes == n and r.setup == label) for n in sizes]
            positions = [i + (j - 1) * width for i in range(len(sizes))]
            bars = ax.bar(positions, values, width, label=label, color=colours[label])
            ax.bar_label(bars, labels=[f"{v:g}" for v in values], fontsize=7, padding=1)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(sizes)), [f"{n:,} nodes" for n in sizes])
        ax.spines[["top", "right"]].set_visible(False)
        ax.margins(y=0.15)
    axes.flat[0].legend(fontsize=8, frameon=False, loc="upper right")
    figure.suptitle("gpushard against time-slicing, the same trace on the real control plane (docs/costs.md)",
                    fontsize=11)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    # No software version in the file: the same figures give the same metadata on every machine.
    figure.savefig(out, metadata={"Software": None, CHUNK: json.dumps([asdict(r) for r in rows])})
    pyplot.close(figure)


def main() -> int:
    try:
        rows = figures(PAGE.read_text())
    except ValueError as exc:
        print(f"gpushard: {exc}; fix the table, or docs/plots.py if the page's layout changed", file=sys.stderr)
        return 2
    draw(rows, OUT)
    print(f"gpushard: {OUT.relative_to(ROOT)} drawn from {len(rows)} rows of {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
