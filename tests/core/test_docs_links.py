"""Every relative link and #anchor in the README, the docs/ pages and benchmarks/RESULTS.md resolves.

Links are read from the real files (outside code blocks and code spans): a target must exist
relative to the page that links it, and an anchor must be a heading of the page it names, by
GitHub's rule (lowercase; punctuation other than `-` and `_` dropped; each space a hyphen; a repeated
heading gets -1, -2, ...). The README links every docs page, so a newcomer can reach each one.

The README's Layout block matches the tree: every path it names exists (an entry's files resolved in
the entry's folder), and it names every package of drafter/ and every module directly in drafter/,
tasks/ and flows/.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted({ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *(ROOT / "docs").glob("*.md")})

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image in a link).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in prose_lines(page.read_text()):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            out.append((i, m.group(1)))
    return out


def broken(page: Path) -> list[str]:
    problems = []
    for line, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{line}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: {path} does not exist")
        elif anchor:
            if dest.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: no heading of {dest.relative_to(ROOT)} has the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert page.exists(), page
    assert broken(page) == []


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for _, t in links(ROOT / "README.md") if t.startswith("docs/")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages, "docs/ holds no pages"
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"


def test_the_checker_finds_what_is_broken(tmp_path, monkeypatch):
    """The checker itself fails on a missing file and on a missing anchor, and reads GitHub's slugs."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Retraining: new data in, a better champion out\n\n## The report, as `make demo` drew it\n"
        "## Notes\n## Notes\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#retraining-new-data-in-a-better-champion-out) [ok](docs/a.md#the-report-as-make-demo-drew-it)\n"
        "[ok](docs/a.md#notes-1) [web](https://example.com/x#y) `[code](nope.md)`\n"
        "```\n[fenced](nope.md)\n```\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#notes-2) [self](#nothing-here)\n")
    assert [p.split(": ", 1)[1] for p in broken(page)] == [
        "(docs/b.md): docs/b.md does not exist",
        "(docs/a.md#notes-2): no heading of docs/a.md has the anchor #notes-2",
        "(#nothing-here): no heading of README.md has the anchor #nothing-here",
    ]


# The README's Layout block: an entry's name starts at column 0, 2 or 4 (two spaces a level), its
# description at column 22; a line with nothing before column 22 continues the entry above it.
NAME_COLUMN = 22
FILE_NAME = re.compile(r"[\w./-]+\.(?:py|md|yaml|json|png|sh)\b")


def layout_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("\n## Layout\n", 1)[1].split("```", 2)[1]
    return [line for line in block.split("\n") if line.strip()]


def layout_paths() -> list[tuple[str, Path]]:
    """(the Layout line, a path it names), the path resolved from the entry it belongs to."""
    out, stack, here = [], [], ROOT
    for line in layout_lines():
        indent = len(line) - len(line.lstrip(" "))
        if indent < NAME_COLUMN:
            depth = indent // 2
            names = line[indent:NAME_COLUMN].split()
            if len(line) > NAME_COLUMN and line[NAME_COLUMN - 1] != " ":  # a long name runs on
                names = line[indent:].split("  ")[0].split()
            first = names[0].rstrip(",")
            del stack[depth:]
            if first.endswith("/"):
                stack.append(first.rstrip("/"))
                here = ROOT.joinpath(*stack)
                out.append((line, here))
            else:
                here = ROOT.joinpath(*stack)
        for name in FILE_NAME.findall(line):
            out.append((line, ROOT / name if "/" in name else here / name))
    return out


def test_every_path_the_layout_names_exists():
    missing = sorted({f"{path.relative_to(ROOT)} (named in: {line.strip()[:80]})"
                      for line, path in layout_paths() if not path.exists()})
    assert missing == [], ("the README's Layout names paths the tree does not have (update its block):\n"
                           + "\n".join(missing))


def test_the_layout_names_every_package_and_top_module():
    named = {path.resolve() for _, path in layout_paths()}
    expected = set()
    for top in ("drafter", "tasks", "flows"):
        expected |= {p.resolve() for p in (ROOT / top).glob("*.py") if p.name != "__init__.py"}
    expected |= {p.resolve() for p in (ROOT / "drafter").iterdir()
                 if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    unnamed = sorted(str(p.relative_to(ROOT)) for p in expected - named)
    assert unnamed == [], "the README's Layout does not name (add a line for each): " + ", ".join(unnamed)


# The files and modules the pages name: `drafter/engines/base.py`, `tests/core/test_layers.py`,
# `drafter.serving.session.ServerSession` must still be there after a move. Placeholders are not.
PLACEHOLDERS = {"profiles/my.yaml", "profiles/x.yaml"}
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:drafter|tests|infra|benchmarks|flows|tasks|profiles|deployments|docs)/[\w./-]*[\w/])")
MODULE = re.compile(r"(?<![\w/.-])(drafter(?:\.\w+)+)")


def _defines(module: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from|import)\b.*\b{name}\b",
                     module.read_text(), re.M) is not None


def _module_resolves(dotted: str) -> bool:
    """drafter.a.b.name: a.b a package or module path under drafter/, name (if any) defined in it.
    A first part that is neither (an event name such as drafter.promoted) is not a module reference."""
    parts = dotted.split(".")
    here = ROOT / parts[0]
    if not ((here / parts[1]).is_dir() or (here / f"{parts[1]}.py").exists()):
        return True
    for part in parts[1:]:
        if (here / part).is_dir():
            here = here / part
        elif here.is_dir() and (here / f"{part}.py").exists():
            here = here / f"{part}.py"
        else:
            module = here / "__init__.py" if here.is_dir() else here
            return module.exists() and _defines(module, part)
    return True


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_module_a_page_names_exists(page):
    missing = []
    for i, line in enumerate(page.read_text().split("\n"), 1):
        for path in REPO_PATH.findall(line):
            if not any(c in path for c in "<*{") and path not in PLACEHOLDERS and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}:{i}: {path}")
        for dotted in MODULE.findall(line):
            if not _module_resolves(dotted):
                missing.append(f"{page.relative_to(ROOT)}:{i}: {dotted}")
    assert missing == [], "named but not in the tree (moved? update the page):\n" + "\n".join(missing)
