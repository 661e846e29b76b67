"""The user documentation, the shipped drafters' READMEs included: every relative link in it points to a file (and
heading) that exists, and README.md and ARCHITECTURE.md stay user documentation (their size bounds; no session numbers,
issue numbers or dates); prose stays wrapped at 120 columns (the generated config reference aside)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "engine" / "README.md",
                ROOT / "bench" / "RESULTS.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "drafters").glob("*/README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped (hyphens and underscores kept), spaces as hyphens, a
    repeated id numbered."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    text = page.read_text()
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no such heading in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## The `store/` (capture)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-store-capture) [web](https://example.com) [gone](missing.md)\n"
                    "[bad](other.md#nowhere) [self](#here)\n\n## Here\n\n```\n[in code](not-checked.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nowhere: no such heading in other.md"]


def test_the_docs_folder_holds_the_guides() -> None:
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"gpu-node.md", "kimi-k25-production.md", "data-sources.md", "tracking.md", "gate-and-promotion.md",
            "troubleshooting.md", "config-reference.md"} <= names


def test_readme_and_architecture_stay_within_their_size() -> None:
    readme, architecture = (ROOT / "README.md").read_text(), (ROOT / "ARCHITECTURE.md").read_bytes()
    assert len(readme.splitlines()) <= 150 and len(readme) <= 12_000
    assert len(architecture) <= 20 * 1024


@pytest.mark.parametrize("name", ["README.md", "ARCHITECTURE.md", "engine/README.md", *(
    f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))])
def test_user_documentation_carries_no_history(name: str) -> None:
    text = (ROOT / name).read_text()
    history = re.findall(r"(?i)\bsession\b|issue #\d+|\b20\d\d-\d\d-\d\d\b", text)
    assert history == [], f"{name} carries history ({history}); figures belong in bench/results.json"


def long_prose_lines(markdown: str, width: int = 120) -> list[int]:
    """Line numbers of prose wider than ``width``: code blocks and table rows are left as they are."""
    long, in_code = [], False
    for n, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("|") and len(line) > width:
            long.append(n)
    return long


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "config-reference.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_is_wrapped_at_120_columns(page: Path) -> None:
    assert long_prose_lines(page.read_text()) == [], f"{page.relative_to(ROOT)}: rewrap these lines"


def test_a_long_prose_line_is_found_and_code_and_tables_are_not() -> None:
    page = "short\n" + "x" * 121 + "\n```\n" + "y" * 200 + "\n```\n| " + "z" * 200 + " |\n"
    assert long_prose_lines(page) == [2]
