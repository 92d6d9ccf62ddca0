"""The links and references of the repository against the files and modules as they are.

For README.md and every docs/**/*.md:
- every relative link ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)`` and image ``![alt](path)``
  resolves to a file or folder inside the repository, and every anchor to a heading of the target file, slugged as
  GitHub slugs headings (lowercase; punctuation other than '-' and '_' removed; each space a '-'; a repeated slug
  gets -1, -2, ...);
- no doc links ../shared, and no doc speaks of sessions.
Links inside fenced code blocks and inline code spans are not read: they are examples, not links.

For every source of the repository (README.md, docs/**/*.md, and the .py and .md files of lrmoe/, kernels/,
benchmarks/, examples/ and tests/, less this file, whose checker tests plant bad references on purpose):
- every citation of a docs/design.md section names one of its headings: ``docs/design.md, section 'Heading'``
  (the convention docs/design.md states at its top), the short forms ``docs/design.md, 'Heading'`` and
  ``design.md, "Heading"``, either quote, and lists (``"A" and "B"``); in docs/design.md, ``section 'Heading'``
  too. In markdown, citations inside code are examples, not read;
- no numbered section (``DESIGN.md section 3``, ``section 4.1``) and no DESIGN.md: the design is docs/design.md
  and its sections have names, not numbers;
- every path into the repository (``benchmarks/layer.py``, ``tests/nn/test_expert_parallel*.py``,
  ``docs/results/``), from the root or from the citing file's folder, names a file or folder that exists (a glob at
  least one), and a test id ``tests/x.py::test_y`` a function or class of that file;
- every dotted name ``lrmoe.a.b`` / ``lrmoe_kernels.a.b`` resolves by import (or as an op, ``torch.ops.lrmoe.x``),
  and where it names a function or class, that is where the function or class lives (defined there, or exported
  by that module's ``__all__``), not a module that merely imports it; every op ``lrmoe::x`` is registered.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def user_docs(root: Path = ROOT) -> list[Path]:
    """README.md and docs/**/*.md."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", flags=re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", flags=re.M)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")
# A citation: "design.md" (or a markdown link to it), a comma or a space, an optional "section", then quoted names.
CITATION = re.compile(r"(?<![\w.-])(?:docs/)?design\.md(?:\]\([^()\s]*\))?(?:,\s*|\s+)(?:sections?\s+)?(?=['\"])")
SELF_CITATION = re.compile(r"\bsections?\s+(?=['\"])")  # inside docs/design.md
QUOTED = re.compile(r"(['\"])([^'\"\n]+(?:\n[^'\"\n]+)?)\1")  # a name in either quote, over two lines at most
LIST_SEP = re.compile(r",?\s+(?:and|or)\s+(?:section\s+)?|,\s*(?:section\s+)?(?=['\"])")
NUMBERED = re.compile(r"DESIGN\.md|\bsections?\s+\d+(?:\.\d+)*\b|§\s*\d")
FOLDERS = ("lrmoe", "kernels", "benchmarks", "examples", "tests", "docs")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(FOLDERS) + r")/[\w./*-]*)(?:::(\w+))?")  # path[::test name]
DOTTED = re.compile(r"(?<![\w.])(lrmoe(?:_kernels)?(?:\.\w+)+)")
OP = re.compile(r"(?<![\w:])lrmoe::(\w+)")
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


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def comments_as_prose(text: str) -> str:
    """Python source with each comment line's leading '#' blanked, so a citation that a comment wraps over two lines
    reads as one (line numbers kept)."""
    return re.sub(r"\n([ \t]*)#", lambda m: "\n" + m.group(1) + " ", text)


def cited_names(text: str, self_citations: bool = False) -> list[tuple[int, str]]:
    """(line, name) of every docs/design.md section that ``text`` cites, whitespace made single; with
    ``self_citations``, also the bare ``section 'X'`` by which docs/design.md cites itself."""
    heads = [*CITATION.finditer(text), *(SELF_CITATION.finditer(text) if self_citations else ())]
    found = {}
    for head in heads:
        pos = head.end()
        while m := QUOTED.match(text, pos):
            found[m.start()] = (line_of(text, m.start()), " ".join(m.group(2).split()))
            sep = LIST_SEP.match(text, m.end())
            if not sep:
                break
            pos = sep.end()
    return [found[pos] for pos in sorted(found)]


def broken_citations(text: str, design_headings: list[str], self_citations: bool = False) -> list[str]:
    """One message per citation of a docs/design.md section that is not one of its headings."""
    known = set(design_headings)
    return [f"line {line}: section '{name}' is not a heading of docs/design.md"
            for line, name in cited_names(text, self_citations) if name not in known]


def numbered_sections(text: str) -> list[str]:
    """One message per DESIGN.md or numbered section (``section 3``, ``section 4.1``, ``§3``)."""
    return [f"line {line_of(text, m.start())}: '{m.group(0)}': cite a heading of docs/design.md by name"
            for m in NUMBERED.finditer(text)]


def missing_paths(text: str, where: Path, root: Path = ROOT) -> list[str]:
    """One message per path into the repository's folders (``benchmarks/layer.py``, ``tests/nn/test_*.py``) that
    names nothing, from the root or from ``where``'s folder and the folders above it up to the root, and per
    ``file.py::name`` (a test's id) whose file defines no function or class of that name."""
    bases = [root, *[d for d in where.parents if root in [d, *d.parents] and d != root]]
    bad = []
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".,")
        if "*" in path:
            found = any(next(base.glob(path), None) for base in bases)
        else:
            found = any((base / path).exists() for base in bases)
        if not found:
            bad.append(f"line {line_of(text, m.start())}: {path} names no file or folder")
        elif m.group(2):
            defined = re.compile(rf"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+{m.group(2)}\b", flags=re.M)
            if not any((base / path).is_file() and defined.search((base / path).read_text()) for base in bases):
                bad.append(f"line {line_of(text, m.start())}: {path} defines no {m.group(2)}")
    return bad


def joined_names(text: str) -> str:
    """The text with a dotted name that a line break splits after a dot (``lrmoe.functional.\n    experts``) made
    whole again: a lowercase continuation only (a capital after a line-ending dot starts a sentence), and not one
    that starts a name of its own (``lrmoe.nn.\nlrmoe.ops``)."""
    return re.sub(r"(?<=\w)\.\n[ \t]*(?:#[ \t]*)?(?=[a-z_])(?!lrmoe[.:_])", ".", text)


class MissingDependency(Exception):
    """A module of lrmoe that imports an optional dependency (torchtitan) this environment lacks."""


def import_module(name: str) -> ModuleType:
    """The module ``name``; MissingDependency where it exists but imports a package that is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        itself = name == missing or name.startswith(missing + ".")  # the module asked for, or its package
        if missing and not itself and not missing.startswith("lrmoe") and importlib.util.find_spec(
            missing.split(".")[0]
        ) is None:
            raise MissingDependency(missing) from e
        raise


def resolve(name: str) -> str | None:
    """None where ``name`` (``lrmoe.functional.retained_rows.retained_dy``) resolves by import, as an attribute of
    the module it names, or as a registered op (``lrmoe.offload_to_host.default``, torch.ops.lrmoe's); else why
    not. A function or class must live in the module that the name puts it in: be defined there, or be in that
    module's ``__all__``. A name inside a module whose optional dependency is not installed is not checked."""
    parts = name.split(".")
    i = len(parts)
    try:
        while True:
            try:
                obj = import_module(".".join(parts[:i]))
                break
            except ImportError:
                i -= 1
                if i == 0:
                    return f"{name}: no module {parts[0]}"
        for k, attr in enumerate(parts[i:], start=i):
            if isinstance(obj, ModuleType) and not hasattr(obj, attr):
                try:
                    import_module(f"{obj.__name__}.{attr}")
                except ImportError:
                    pass
            if k == 1 and parts[0] == "lrmoe" and not hasattr(obj, attr) and hasattr(torch.ops.lrmoe, attr):
                op = getattr(torch.ops.lrmoe, attr)  # an op by its graph name: lrmoe.x.default
                overload_missing = parts[2:] and not hasattr(op, parts[2])
                return f"{name}: op lrmoe::{attr} has no {parts[2]}" if overload_missing else None
            if why := _resolve_attr(name, parts, k, obj, attr):
                return why
            obj = getattr(obj, attr)
    except MissingDependency:
        return None
    return None


def _resolve_attr(name: str, parts: list[str], k: int, obj, attr: str) -> str | None:
    """Why ``obj.attr`` (the k-th part of ``name``) does not resolve, or None."""
    if not hasattr(obj, attr):
        return f"{name}: {'.'.join(parts[:k])} has no {attr}"
    child = getattr(obj, attr)
    if isinstance(obj, ModuleType) and (inspect.isfunction(child) or inspect.isclass(child)):
        home = getattr(child, "__module__", obj.__name__)
        if home != obj.__name__ and attr not in getattr(obj, "__all__", ()):
            return f"{name}: {attr} lives in {home}; {obj.__name__} only imports it"
    return None


def unresolved_names(text: str) -> list[str]:
    """One message per dotted lrmoe name or lrmoe:: op of ``text`` that does not resolve."""
    text = joined_names(text)
    bad = []
    for m in DOTTED.finditer(text):
        if why := resolve(m.group(1)):
            bad.append(f"line {line_of(text, m.start())}: {why}")
    for m in OP.finditer(text):
        if not hasattr(torch.ops.lrmoe, m.group(1)):
            bad.append(f"line {line_of(text, m.start())}: lrmoe::{m.group(1)} is no registered op")
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


def test_design_headings_can_be_cited():
    """Citations quote a heading in single or double quotes, so no heading may hold one, and none may repeat."""
    assert len(DESIGN_HEADINGS) >= 10
    assert not [h for h in DESIGN_HEADINGS if "'" in h or '"' in h]
    assert len(set(DESIGN_HEADINGS)) == len(DESIGN_HEADINGS)
    assert {"The metric", "Selection rules", "The five primitives", "Expert parallelism", "Architecture"} <= set(
        DESIGN_HEADINGS
    )


def sources(root: Path = ROOT) -> list[Path]:
    """Every file whose references are checked: README.md, docs/**/*.md and the .py and .md files of the code
    folders, less this file (its checker tests plant bad references)."""
    this = Path(__file__).resolve()
    code = [p for folder in ("lrmoe", "kernels", "benchmarks", "examples", "tests")
            for p in sorted((root / folder).rglob("*")) if p.suffix in (".py", ".md") and p.resolve() != this]
    return [*user_docs(root), *code]


def readable(path: Path) -> str:
    """A Python file's text with its comments read as prose (a citation may wrap over comment lines); any other
    file's text as it is."""
    text = path.read_text()
    return comments_as_prose(text) if path.suffix == ".py" else text


SOURCES = sources()


def test_the_sources_are_found():
    names = {rel(p) for p in SOURCES}
    assert {"README.md", "docs/design.md", "kernels/README.md", "lrmoe/functional/expert_step.py",
            "benchmarks/layer.py", "tests/conftest.py"} <= names
    assert len(names) > 150
    assert "tests/test_docs_links.py" not in names


def test_every_design_section_citation_names_a_heading():
    """In both quote styles, in code and docs (a markdown file's code blocks and spans are examples: not read)."""
    bad = []
    for path in SOURCES:
        text = prose(path.read_text()) if path.suffix == ".md" else readable(path)
        msgs = broken_citations(text, DESIGN_HEADINGS, self_citations=path == DESIGN)
        bad += [f"{rel(path)}: {msg}" for msg in msgs]
    assert not bad, "\n".join(bad)


def test_citations_are_read_in_code_and_docs():
    """The citation reader finds the repository's citations, in both quote styles: the check above is not vacuous."""
    cited = {rel(p): [n for _, n in cited_names(readable(p), self_citations=p == DESIGN)] for p in SOURCES}
    assert "Expert parallelism" in cited["lrmoe/functional/expert_parallel.py"]  # double quotes, over two lines
    assert "The metric" in cited["kernels/scoring.py"]  # single quotes
    assert "Selection rules" in cited["docs/quality.md"]
    assert "The metric" in cited["docs/design.md"]  # docs/design.md citing itself
    assert sum(map(len, cited.values())) >= 25


def test_no_numbered_section_or_design_md():
    bad = [f"{rel(p)}: {msg}" for p in SOURCES for msg in numbered_sections(readable(p))]
    assert not bad, "\n".join(bad)


def test_every_repository_path_exists():
    """Paths in code and docs (code blocks included: their commands name real scripts)."""
    bad = [f"{rel(p)}: {msg}" for p in SOURCES for msg in missing_paths(readable(p), p)]
    assert not bad, "\n".join(bad)
    assert sum(len(PATH.findall(p.read_text())) for p in SOURCES) >= 200  # the reader finds paths at all


def test_every_dotted_name_and_op_resolves():
    bad = [f"{rel(p)}: {msg}" for p in SOURCES for msg in unresolved_names(readable(p))]
    assert not bad, "\n".join(bad)
    assert sum(len(DOTTED.findall(p.read_text())) + len(OP.findall(p.read_text())) for p in SOURCES) >= 200


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_no_doc_points_outside_the_repository(doc):
    text = doc.read_text()
    assert "../shared" not in text, f"{rel(doc)} refers to ../shared, which is not in the repository"


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
    heads = headings("# Design\n## The metric\n## Selection rules\n## Expert parallelism\n")
    good = (
        "see docs/design.md, section 'The metric', and docs/design.md,\nsection 'Selection\nrules'; docs/design.md, "
        "'Design'\n(docs/design.md, \"The metric\" and \"Expert\n    parallelism\") [design.md](design.md), 'Design'"
    )
    assert broken_citations(good, heads) == []
    assert [n for _, n in cited_names(good)] == ["The metric", "Selection rules", "Design", "The metric",
                                                 "Expert parallelism", "Design"]
    bad = broken_citations("docs/design.md, section 'The metrics'\nand docs/design.md, 'Nope'", heads)
    assert len(bad) == 2 and "'The metrics'" in bad[0] and bad[1].startswith("line 2:")
    # Double quotes, the second name of a list, a comment wrapped over two lines, a design.md citing itself.
    bad = broken_citations('(docs/design.md, "The selective backward")', heads)
    assert len(bad) == 1 and "'The selective backward'" in bad[0]
    bad = broken_citations("(docs/design.md, 'The metric' and \"Experts\")", heads)
    assert len(bad) == 1 and "'Experts'" in bad[0]
    python = "x = 1  # see docs/design.md, \"The selective\n    # backward\"\n"
    assert "'The selective backward'" in broken_citations(comments_as_prose(python), heads)[0]
    assert broken_citations("the rule of section 'Selection rule'", heads) == []
    assert len(broken_citations("the rule of section 'Selection rule'", heads, self_citations=True)) == 1


def test_checker_finds_numbered_sections():
    assert numbered_sections("the score (docs/design.md, 'The metric'); the sections below; 3 sections") == []
    bad = numbered_sections("(DESIGN.md section 3)\nThe contract (section 4.1) and §2")
    assert [m.split(": ")[1] for m in bad] == ["'DESIGN.md'", "'section 3'", "'section 4.1'", "'§2'"], bad
    assert bad[2].startswith("line 2:")


def test_checker_finds_missing_paths(tree):
    (tree / "benchmarks").mkdir()
    (tree / "benchmarks" / "layer.py").write_text("")
    (tree / "tests" / "nn").mkdir(parents=True)
    (tree / "tests" / "nn" / "test_ep.py").write_text("def test_one():\n    pass\n")
    conftest = tree / "tests" / "conftest.py"
    good = ("python benchmarks/layer.py peers; docs/target.md, docs/data/ and docs/data/x.json.\n"
            "tests/nn/test_ep*.py, tests/**/test_*.py, https://github.com/x/lrmoe/tree/main/docs/nope.md\n"
            "tests/nn/test_ep.py::test_one.\n")
    assert missing_paths(good, tree / "README.md", root=tree) == []
    assert missing_paths('SLOW = ("nn/test_ep.py", "tests/nn/test_ep.py")', conftest, root=tree) == []
    bad = missing_paths("see benchmarks/backward_capacity_plan.py\n(docs/nope/) tests/nn/test_expert*.py "
                        "lrmoe/x.py tests/nn/test_ep.py::test_two", tree / "README.md", root=tree)
    assert [m.split(": ")[1] for m in bad] == ["benchmarks/backward_capacity_plan.py names no file or folder",
                                               "docs/nope/ names no file or folder",
                                               "tests/nn/test_expert*.py names no file or folder",
                                               "lrmoe/x.py names no file or folder",
                                               "tests/nn/test_ep.py defines no test_two"]
    assert bad[0].startswith("line 1:") and bad[1].startswith("line 2:")
    # From the citing file's folder, "tests/test_ep.py" is tests/tests/test_ep.py; from the root, not there either.
    assert len(missing_paths("tests/test_ep.py", conftest, root=tree)) == 1


def test_checker_finds_unresolved_names():
    good = ("lrmoe.functional.retained_rows.retained_dy, lrmoe.functional.score_pairs (exported), lrmoe.nn.LRMoE.\n"
            "lrmoe.ops._define.define_op and lrmoe_kernels.launch; lrmoe.offload_to_host.default; lrmoe::ep_plan, "
            "lrmoe::gather_scale_rows. The layer is lrmoe.nn.\nThe step is in lrmoe.functional.\n    expert_step.")
    assert unresolved_names(good) == []
    bad = unresolved_names(
        "lrmoe.functional.expert_step.take_rows\n(lrmoe.functional.experts.\n    retained_dy) lrmoe.nope, "
        "lrmoe.functional.check_placement, lrmoe.functional.expert_step.retained_dy lrmoe::no_such_op "
        "lrmoe.ops.rows.nope lrmoe.swiglu_sqnorm.nope"
    )
    assert len(bad) == 8, bad
    assert "take_rows lives in lrmoe.functional.retained_rows; lrmoe.functional.expert_step only imports" in bad[0]
    assert bad[1].startswith("line 2:") and "lrmoe.functional.experts has no retained_dy" in bad[1]
    assert "lrmoe has no nope" in bad[2]
    assert "lrmoe.functional has no check_placement" in bad[3]
    assert "lrmoe.functional.expert_step has no retained_dy" in bad[4]
    assert "lrmoe.ops.rows has no nope" in bad[5]
    assert "op lrmoe::swiglu_sqnorm has no nope" in bad[6]
    assert "lrmoe::no_such_op is no registered op" in bad[7]


def test_checker_skips_names_behind_a_missing_dependency(tmp_path, monkeypatch):
    """A module that imports an optional dependency that is not installed (torchtitan) cannot be checked here; one
    whose import fails otherwise is reported."""
    (tmp_path / "probe_optional.py").write_text("import no_such_dependency_xyz\ndef f(): pass\n")
    (tmp_path / "probe_broken.py").write_text("from lrmoe.functional import no_such_name_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("probe_optional.f") is None
    assert resolve("probe_broken.f") is not None
    assert resolve("probe_absent.f") == "probe_absent.f: no module probe_absent"
