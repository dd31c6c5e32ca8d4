"""Every relative link in README.md and docs/ resolves to a file or folder of this repository (and a link to a
heading of a Markdown page, to a heading that page has); the front page and the benchmarks page stay within their
sizes; committed result files name no absolute path of the machine they ran on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)\)|!\[[^\]]*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [a or b for a, b in LINK.findall(text)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: the heading's text (links reduced to theirs) lowercased, punctuation other than
    hyphens and underscores dropped, spaces made hyphens."""
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} does not resolve"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.relative_to(ROOT)}: no heading #{anchor} in {path or page.name}"


def test_the_link_checker_sees_links_and_headings():
    assert "docs/cli.md#run" in links(ROOT / "README.md")
    assert "one-decode-attention-call-bench-op" in anchors(ROOT / "docs" / "benchmarks.md")
    assert "batched-decoding-bench-e2e---batch" in anchors(ROOT / "docs" / "benchmarks.md")


def test_every_docs_page_is_linked_from_the_front_page():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(ROOT / "README.md")}
    assert {p for p in (ROOT / "docs").glob("*.md")} <= linked


def test_page_sizes():
    assert len((ROOT / "README.md").read_bytes()) <= 8000, "the front page is read in five minutes"
    assert len((ROOT / "docs" / "benchmarks.md").read_bytes()) <= 20000


def test_every_docs_page_opens_with_what_it_covers():
    for page in (ROOT / "docs").glob("*.md"):
        first = page.read_text().split("\n\n")[1]
        assert first.startswith("This page covers"), page.name


ABSOLUTE = re.compile(r"^(/|~|[A-Za-z]:\\)")


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def test_committed_results_name_no_absolute_path():
    files = [p for ext in ("json", "jsonl") for p in (ROOT / "docs").rglob(f"*.{ext}")]
    assert files
    for path in files:
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        for line in filter(None, lines):
            bad = [s for s in strings(json.loads(line)) if ABSOLUTE.match(s)]
            assert not bad, f"{path.relative_to(ROOT)}: {bad[:3]}"
