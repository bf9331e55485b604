"""The README and docs/: short README, readable lines, the reference pages present, every relative link resolving.

Links are checked as GitHub renders them: a path relative to the page, optionally with a `#heading` anchor,
which must name a heading of the target page (GitHub's slugs: lower case, punctuation dropped, spaces to
hyphens). Links with a scheme (https:, mailto:) are not fetched.
"""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = ("passes.md", "guards-and-recompiles.md", "cli.md", "report.md", "benchmarks.md", "troubleshooting.md")
# Written on another branch (issue 40's training-loop page); checked like any other link once it is here.
ELSEWHERE = {DOCS / "training-loops.md"}
MAX_README_LINES = 250
MAX_LINE = 400

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _markdown_files() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(path: pathlib.Path) -> list[str]:
    """The page's lines outside fenced code blocks (a link inside code is not a link)."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(path) if line.startswith("#")}


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_line_too_long(path):
    long = [(n, len(line)) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_LINE]
    assert not long, f"{path.name}: lines over {MAX_LINE} characters (line, length): {long}"


def test_reference_pages_exist_and_readme_links_them():
    readme = README.read_text(encoding="utf-8")
    for page in PAGES:
        assert (DOCS / page).is_file(), f"docs/{page} is missing"
        assert f"(docs/{page})" in readme, f"README.md does not link docs/{page}"
    assert "(docs/training-loops.md)" in readme
    assert "(ARCHITECTURE.md)" in readme


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for line in _prose(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if linked in ELSEWHERE and not linked.exists():
                continue
            if not linked.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{path.name}: broken links: {broken}"


def test_readme_results_say_how_to_regenerate_and_carry_no_commit_hashes():
    readme = README.read_text(encoding="utf-8")
    assert re.search(r"<!-- results: regenerate with .+-->", readme)
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", readme) if re.search(r"\d", h) and re.search(r"[a-f]", h)]
    assert not hashes, f"commit hashes in README.md: {hashes}"


def test_every_pass_is_documented():
    from fxopt.passes import PASSES

    readme = README.read_text(encoding="utf-8")
    headings = {line.strip() for line in _prose(DOCS / "passes.md") if line.startswith("## ")}
    for name in PASSES:
        assert f"| `{name}` |" in readme, f"the README's passes table has no row for {name}"
        assert f"## {name}" in headings, f"docs/passes.md has no section for {name}"


def test_report_page_lists_the_json_keys():
    from fxopt.frontends.cli_inspect import JSON_KEYS

    page = (DOCS / "report.md").read_text(encoding="utf-8")
    missing = [key for group in ("top", "pass", "estimated", "summary") for key in JSON_KEYS[group]
               if f"`{key}" not in page]
    assert not missing, f"docs/report.md does not mention JSON keys: {missing}"
