"""We test docs/plots.py, which draws docs/img/costs.png from the tables of docs/costs.md:
- it reads, for each size of the page (100, 500 and 2,000 nodes), time-slicing, gpushard's device-plugin
  backend with one webhook and its dra backend: pods bound a second, a create's p50 and p99, API requests
  per pod, the figures of the page's own cells;
- a table that lacks one of those rows, or a page without such tables, is refused, naming what is missing;
- docs/img/costs.png shows the page's figures as they are now (the PNG records what it drew: after a
  change of docs/costs.md, run make docs-plots);
- where matplotlib is installed, drawing writes a PNG that records its figures.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plots():
    spec = importlib.util.spec_from_file_location("gpushard_docs_plots", ROOT / "docs/plots.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_figures_are_the_pages_cells(plots):
    rows = plots.figures(plots.PAGE.read_text())
    assert [(r.nodes, r.setup) for r in rows] == [(n, s) for n in (100, 500, 2000) for s in plots.SETUPS.values()]
    first = rows[0]
    # The 100-node table's time-slicing row: "40.4 (1.00)", "7.5 / 18.0", "3.01 (1.00)".
    line = next(x for x in plots.PAGE.read_text().splitlines() if x.startswith("| time-slicing (baseline) |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert first.bound_per_s == float(cells[2].split(" ")[0])
    assert (first.create_p50_ms, first.create_p99_ms) == tuple(float(x) for x in cells[4].split(" / "))
    assert first.requests_per_pod == float(cells[6].split(" ")[0])
    assert all(v > 0 for r in rows for v in (r.bound_per_s, r.create_p50_ms, r.create_p99_ms, r.requests_per_pod))


def test_a_missing_row_or_table_is_refused(plots):
    text = plots.PAGE.read_text()
    without = "\n".join(x for x in text.splitlines() if not x.startswith("| gpushard, dra | 1 |"))
    with pytest.raises(ValueError, match="no row for"):
        plots.figures(without)
    with pytest.raises(ValueError, match="no table of a size"):
        plots.figures("# nothing here\n")


def test_the_picture_shows_the_page_as_it_is(plots):
    drawn = plots.recorded(plots.OUT)
    assert drawn, f"{plots.OUT} records no figures: make it with make docs-plots"
    assert drawn == plots.figures(plots.PAGE.read_text()), "docs/costs.md changed since its plot: run make docs-plots"


def test_drawing_records_the_figures(plots, tmp_path):
    pytest.importorskip("matplotlib")
    rows = plots.figures(plots.PAGE.read_text())
    out = tmp_path / "costs.png"
    plots.draw(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.recorded(out) == rows
