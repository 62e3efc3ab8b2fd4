"""The Markdown documentation is tidy: every relative link in README.md, CHANGELOG.md and docs/*.md
points to a file that exists (and, for a link to a heading, to a heading that exists), and prose
lines stay within 120 columns (table rows and generated-block markers excepted). Fast: no server."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def _prose(page: Path) -> list[tuple[int, str]]:
    return list(enumerate(page.read_text().splitlines(), 1))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_lines_within_120_columns(page: Path) -> None:
    long = [f"line {n} ({len(line)} columns)" for n, line in _prose(page)
            if len(line) > 120 and not line.startswith(("|", "<!--"))]
    assert not long, f"{page.relative_to(ROOT)}: " + ", ".join(long)


def test_docs_cite_no_commits() -> None:
    """User docs describe the library as it is: commit hashes belong in CHANGELOG.md (the generated
    benchmark blocks name their run's commit, from docs/bench/run.json)."""
    hashes = re.compile(r"`[0-9a-f]{7,12}`")
    found = []
    for page in PAGES:
        if page.name == "CHANGELOG.md":
            continue
        text = re.sub(r"<!-- bench:(headline:)?begin.*?<!-- bench:(headline:)?end -->", "", page.read_text(),
                      flags=re.S)
        found += [f"{page.relative_to(ROOT)}: {h}" for h in hashes.findall(text)]
    assert not found, found


def test_readme_is_a_landing_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for needed in ("make demo", "make test", "pip install", "docs/benchmarks.md", "bench:headline:begin"):
        assert needed in text, needed
