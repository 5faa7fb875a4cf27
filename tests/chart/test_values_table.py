"""docs/helm.md's values table is the chart's values.yaml, value for value.

We test:
- every value of values.yaml has a comment that says what it does and, after "Lands in:", where it goes;
- every value appears in the table made from those comments (tests/chart/valuesdoc.py), with its default;
- the table in docs/helm.md is that table, as `make chart-docs` writes it.
"""

from __future__ import annotations

import yaml

from tests.chart import helm, valuesdoc

PAGE = helm.ROOT / "docs" / "helm.md"


def leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_value_says_what_it_does_and_where_it_lands():
    rows = valuesdoc.values()
    bare = [row.path for row in rows if not row.what or not row.lands]
    assert not bare, f"values.yaml: give these a comment with 'Lands in:' above them: {bare}"


def test_every_value_is_in_the_table():
    table = valuesdoc.table()
    documented = {row.path for row in valuesdoc.values()}
    for leaf in leaves(yaml.safe_load(valuesdoc.VALUES.read_text())):
        owner = next((path for path in documented if leaf == path or leaf.startswith(path + ".")), None)
        assert owner, f"{leaf} is not in the values table"
        assert f"| `{owner}` |" in table


def test_the_docs_table_is_current():
    page = PAGE.read_text()
    assert valuesdoc.BEGIN in page and valuesdoc.END in page, "docs/helm.md lost the values table's markers"
    assert valuesdoc.written(page) == page, "docs/helm.md's values table is stale: run make chart-docs"
