"""The README stays a short page for a user, and the documentation site (mkdocs.yml over docs/) leaves no page out.

We test:
- the README is at most 150 lines;
- every relative link and image of the README names a file of the repository, and each anchor a heading
  of the Markdown page it names (as GitHub makes anchors);
- mkdocs.yml builds from docs/ and its nav lists every docs/*.md page once, and only pages that exist;
- the site's link checks are warnings, so that `make docs` (--strict) fails on a broken link or anchor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


class _Loader(yaml.SafeLoader):
    """mkdocs.yml names Python objects (!!python/name:...): read them as nothing, never import them."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
CONFIG = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in nav_pages(value)]
    return []


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found = set()
    for heading in re.findall(r"^#+ +(.+?) *$", text, flags=re.M):
        plain = re.sub(r"[^\w\- ]", "", heading.replace("`", "")).lower()
        found.add(plain.replace(" ", "-"))
    return found


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the details into docs/"


def test_every_relative_link_of_the_readme_resolves():
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(relative) >= 10, relative
    for link in relative:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"README.md links to {link}, and {path} does not exist"
        if anchor:
            assert target.suffix == ".md", link
            assert anchor in anchors(target), f"README.md links to {link}: {path} has no such heading"


def test_the_nav_lists_every_page_once():
    assert CONFIG["docs_dir"] == "docs"
    listed = nav_pages(CONFIG["nav"])
    assert len(listed) == len(set(listed)), sorted(p for p in listed if listed.count(p) > 1)
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert set(listed) - pages == set(), "the nav names pages that do not exist"
    assert pages - set(listed) == set(), "pages that no nav entry reaches (add them to mkdocs.yml's nav)"


@pytest.mark.parametrize("check", ["omitted_files", "not_found", "absolute_links", "unrecognized_links", "anchors"])
def test_broken_links_fail_the_strict_build(check):
    assert CONFIG["validation"][check] == "warn"
