"""Every relative link and #anchor in README.md and docs/*.md resolves: the file exists, and the anchor is one of
its headings as GitHub slugs them (or an explicit <a id=...>)."""

import re
from pathlib import Path

import pytest
from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXPLICIT = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose(path: Path) -> str:
    """The file without fenced code blocks and inline code, where a bracket is no link."""
    return CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set(EXPLICIT.findall(path.read_text(encoding="utf-8")))
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path)) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_check_sees_a_missing_file_and_a_stale_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top, it's `here` (2026)\n\n## Top, it's here (2026)\n")
    assert anchors(tmp_path / "a.md") == {"top-its-here-2026", "top-its-here-2026-1"}
    (tmp_path / "b.md").write_text("[x](a.md#top-its-here-2026) [y](c.md) `[z](d.md)` ![p](a.md) [w](https://x.org)\n")
    assert links(tmp_path / "b.md") == ["a.md#top-its-here-2026", "c.md", "a.md"]
