"""The documentation a newcomer walks into (issue #48): a README short enough to read, links that lead somewhere, and
an index of docs/results/ that names every results folder.

The index (`docs/results/README.md`) has one line per folder, each a link to it.  It covers every directory under
docs/results/, recursively, with one exception: the archive of superseded runs, `docs/results/archive/`, is indexed
by its top folders only (`archive/agent-deploy/`, `archive/worldmodel-v3/`, ...), since each of those is one closed
piece of history whose own README or index line says what lies inside it.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
ARCHIVE = RESULTS / "archive"
INDEX = RESULTS / "README.md"

README_MAX_LINES = 220
"""The README says what rlflow is, how to run it and where to read more; the rest lives under docs/."""

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_MARKDOWN_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"<a\s[^>]*?href\s*=\s*[\"']([^\"']+)[\"']", re.I)


def links(text: str) -> list[str]:
    """The targets of the markdown links (`[text](target)`, images too) and `<a href>`s in `text`, outside code."""
    prose = _CODE.sub("", _FENCE.sub("", text))
    return _MARKDOWN_LINK.findall(prose) + _HTML_LINK.findall(prose)


def local_target(page: Path, target: str) -> Path | None:
    """Where a relative link on `page` leads, without its anchor; None for web links and anchors within the page."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    return (page.parent / path).resolve() if path else None


def broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        for target in links(page.read_text(encoding="utf-8")):
            path = local_target(page, target)
            if path is not None and not path.exists():
                name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
                broken.append(f"{name}: {target}")
    return broken


def pages() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


def folders_to_index() -> set[Path]:
    """Every directory under docs/results/, but inside the archive only its top folders; not `__pycache__` (a results
    script importing another leaves one) nor hidden folders."""
    found = set()
    for path in RESULTS.rglob("*"):
        if not path.is_dir() or any(p.startswith(("__", ".")) for p in path.relative_to(RESULTS).parts):
            continue
        inside_archive = path.is_relative_to(ARCHIVE)
        if inside_archive and len(path.relative_to(ARCHIVE).parts) > 1:
            continue
        found.add(path.resolve())
    return found


def indexed_folders(index: Path = INDEX) -> set[Path]:
    targets = (local_target(index, t) for t in links(index.read_text(encoding="utf-8")))
    return {t for t in targets if t is not None and t.is_dir()}


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_every_relative_link_in_the_readme_and_docs_leads_somewhere():
    assert broken_links(pages()) == []


def test_the_results_index_lists_every_results_folder():
    missing = folders_to_index() - indexed_folders()
    assert sorted(str(p.relative_to(RESULTS)) for p in missing) == []


# The checks above must fail when the documentation is broken, not only pass when it is not.

def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "file.md").write_text("x")
    page.write_text("[ok](there/file.md#part) [folder](there/) <a href=\"there\">ok</a> [web](https://example.org)\n"
                    "[gone](there/missing.md) ![img](nowhere.png) <a href='../away.md'>x</a> [anchor](#here)\n"
                    "`[code](not/a/link.md)`\n```\n[fenced](not/a/link.md)\n```\n")
    assert sorted(links(page.read_text())) == sorted(["there/file.md#part", "there/", "there", "https://example.org",
                                                      "there/missing.md", "nowhere.png", "../away.md", "#here"])
    assert [b.split(": ", 1)[1] for b in broken_links([page])] == ["there/missing.md", "nowhere.png", "../away.md"]


def test_the_index_check_finds_a_missing_folder(tmp_path, monkeypatch):
    results = tmp_path / "results"
    for folder in ("a/b", "c", "archive/old/deep", "a/__pycache__"):
        (results / folder).mkdir(parents=True)
    index = results / "README.md"
    index.write_text("- [a/](a/)\n- [a/b/](a/b/)\n- [archive/](archive/)\n- [archive/old/](archive/old/)\n")
    monkeypatch.setattr(sys.modules[__name__], "RESULTS", results)
    monkeypatch.setattr(sys.modules[__name__], "ARCHIVE", results / "archive")
    missing = folders_to_index() - indexed_folders(index)
    assert missing == {(results / "c").resolve()}  # archive/old/deep is inside an archived folder: not required
