"""The links and section references of README.md and docs/ against the files as they are.

For README.md and every docs/**/*.md:
- every relative link ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)`` and image ``![alt](path)``
  resolves to a file or folder inside the repository, and every anchor to a heading of the target file, slugged as
  GitHub slugs headings (lowercase; punctuation other than '-' and '_' removed; each space a '-'; a repeated slug
  gets -1, -2, ...);
- every section reference ``docs/design.md, section 'Heading'`` (the convention docs/design.md states at its top;
  the short form ``docs/design.md, 'Heading'`` is read too) names a heading of docs/design.md;
- no doc links ../shared or mentions DESIGN.md, and no doc speaks of sessions.
The same section references in the code (lrmoe/, kernels/, benchmarks/, examples/, tests/) must name a heading too.
Links and references inside fenced code blocks and inline code spans are not read: they are examples, not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def user_docs(root: Path = ROOT) -> list[Path]:
    """README.md and docs/**/*.md."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", flags=re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", flags=re.M)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")
CITATION = re.compile(r"docs/design\.md,\s+(?:section\s+)?'([^']+)'")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def without_fences(text: str) -> str:
    """The text with every fenced code block blanked out (newlines kept, so line numbers stay)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return INLINE_CODE.sub(lambda m: " " * len(m.group(0)), without_fences(text))


def heading_text(raw: str) -> str:
    """A heading as rendered: links reduced to their text, code spans to their content, whitespace single."""
    raw = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    raw = raw.replace("`", "")
    return " ".join(raw.split())


def headings(text: str) -> list[str]:
    return [heading_text(m.group(2)) for m in HEADING.finditer(without_fences(text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's rendered text."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        base = slug(h)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(doc: Path, text: str, root: Path = ROOT) -> list[str]:
    """One message per relative link of ``text`` (the contents of ``doc``) that does not resolve."""
    bad = []
    for m in LINK.finditer(prose(text)):
        target = m.group(1)
        if not target or SCHEME.match(target):
            continue  # an empty link or an absolute URL (http:, mailto:): not a file of this repository
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / unquote(path_part)).resolve() if path_part else doc.resolve()
        line = text.count("\n", 0, m.start()) + 1
        where = f"{doc.name}:{line}: ({target})"
        if not path_part:
            if anchor not in anchors(text):
                bad.append(f"{where} names no heading of {doc.name}")
        elif root.resolve() not in [dest, *dest.parents]:
            bad.append(f"{where} leaves the repository")
        elif not dest.exists():
            bad.append(f"{where} names no file")
        elif anchor:
            if dest.suffix != ".md":
                bad.append(f"{where} has an anchor into a file that is not markdown")
            elif anchor not in anchors(dest.read_text()):
                bad.append(f"{where} names no heading of {dest.name}")
    return bad


def broken_citations(text: str, design_headings: list[str]) -> list[str]:
    """One message per ``docs/design.md, section 'X'`` whose X is not a heading of docs/design.md."""
    known = set(design_headings)
    bad = []
    for m in CITATION.finditer(text):
        name = " ".join(m.group(1).split())
        if name not in known:
            bad.append(f"line {text.count(chr(10), 0, m.start()) + 1}: section '{name}' is not a heading")
    return bad


DOCS = user_docs()
DESIGN_HEADINGS = headings(DESIGN.read_text()) if DESIGN.exists() else []


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_docs_are_found():
    names = {rel(p) for p in DOCS}
    assert {"README.md", "docs/design.md", "docs/performance.md", "docs/api.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_resolves(doc):
    bad = broken_links(doc, doc.read_text())
    assert not bad, "broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_design_section_reference_names_a_heading(doc):
    bad = broken_citations(prose(doc.read_text()), DESIGN_HEADINGS)
    assert not bad, f"{rel(doc)}:\n" + "\n".join(bad)


def test_design_headings_can_be_cited():
    """Citations quote a heading in single quotes, so no heading may hold one, and none may repeat."""
    assert len(DESIGN_HEADINGS) >= 10
    assert not [h for h in DESIGN_HEADINGS if "'" in h]
    assert len(set(DESIGN_HEADINGS)) == len(DESIGN_HEADINGS)
    assert {"The metric", "Selection rules", "The five primitives", "Expert parallelism", "Architecture"} <= set(
        DESIGN_HEADINGS
    )


def test_code_section_references_name_a_heading():
    """Docstrings and comments that cite docs/design.md by section cite one that exists."""
    this = Path(__file__).resolve()
    bad = []
    for folder in ("lrmoe", "kernels", "benchmarks", "examples", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() == this:
                continue
            bad += [f"{rel(path)}: {msg}" for msg in broken_citations(path.read_text(), DESIGN_HEADINGS)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_no_doc_points_outside_the_repository(doc):
    text = doc.read_text()
    assert "../shared" not in text, f"{rel(doc)} refers to ../shared, which is not in the repository"
    assert "DESIGN.md" not in text, f"{rel(doc)} cites DESIGN.md; the design is docs/design.md"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_no_doc_speaks_of_sessions(doc):
    hits = [line for line in doc.read_text().splitlines() if re.search(r"\bsessions?\b", line, flags=re.I)]
    assert not hits, f"{rel(doc)} keeps a diary:\n" + "\n".join(hits)


# The checker itself, on synthetic files: it must be able to fail.


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "target.md").write_text(
        "# Target\n\n## The layer against transformers' block\n\n## `backward_capacity`\n\n## Options at EP = 2\n\n"
        "## Notes\n\n## Notes\n\n```python\n# not a heading\n```\n"
    )
    (tmp_path / "docs" / "data").mkdir()
    (tmp_path / "docs" / "data" / "x.json").write_text("{}")
    return tmp_path


def test_slugs_follow_github():
    assert slug(heading_text("The layer against transformers' block")) == "the-layer-against-transformers-block"
    assert slug(heading_text("`backward_capacity`")) == "backward_capacity"
    assert slug(heading_text("Options measured at EP = 2")) == "options-measured-at-ep--2"
    assert slug(heading_text("Time to a fixed held-out loss (the paper's Table 1)")) == (
        "time-to-a-fixed-held-out-loss-the-papers-table-1"
    )
    assert anchors("# A\n## A\n## A\n") == {"a", "a-1", "a-2"}
    assert anchors("```\n# comment in code\n```\n    # indented code\n") == set()


def test_checker_accepts_good_links(tree):
    doc = tree / "docs" / "index.md"
    text = (
        "[t](target.md) [t](target.md#the-layer-against-transformers-block) [t](target.md#backward_capacity)\n"
        "[t](target.md#options-at-ep--2) [t](target.md#notes-1) ![img](data/x.json) [dir](data/) [me](#index)\n"
        "[web](https://example.com/x.md#nope) `[code](missing.md)`\n\n```\n[block](missing.md)\n```\n# Index\n"
    )
    assert broken_links(doc, text, root=tree) == []


def test_checker_finds_broken_links(tree):
    doc = tree / "docs" / "index.md"
    text = (
        "# Index\n[a](missing.md)\n[b](target.md#no-such-heading)\n[c](#nowhere)\n"
        "[d](../../outside.md)\n[e](target.md#not-a-heading)\n![f](data/y.png)\n[g](data/x.json#key)\n"
    )
    bad = broken_links(doc, text, root=tree)
    assert len(bad) == 7, bad
    assert "index.md:2: (missing.md) names no file" in bad[0]
    assert "names no heading of target.md" in bad[1] and "index.md:3" in bad[1]
    assert "names no heading of index.md" in bad[2]
    assert "leaves the repository" in bad[3]
    assert "names no file" in bad[5] and "data/y.png" in bad[5]
    assert "not markdown" in bad[6]


def test_checker_finds_broken_section_references():
    heads = headings("# Design\n## The metric\n## Selection rules\n")
    good = "see docs/design.md, section 'The metric', and docs/design.md,\nsection 'Selection\nrules'; docs/design.md, 'Design'"
    assert broken_citations(good, heads) == []
    bad = broken_citations("docs/design.md, section 'The metrics'\nand docs/design.md, 'Nope'", heads)
    assert len(bad) == 2 and "'The metrics'" in bad[0] and bad[1].startswith("line 2:")
