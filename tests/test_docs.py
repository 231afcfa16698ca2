"""The documentation a newcomer walks into (issue #48): a README short enough to read, links that lead somewhere, and
an index of docs/results/ that names every results folder.

Since issue #80 docs/results/ keeps only the runs the README, docs/, rlflow/rewrites/README.md or a Makefile target
cite.  Every folder there has a `manifest.json` (date, commit, machine, command, question, status), and the index
(`docs/results/README.md`) is what `benchmarks/results_index.py` writes from the manifests: one line per folder, each
a link to it, and the runs that left the tree with the commit to check out for each.  Its size is held by
tests/test_layout.py.
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
INDEX = RESULTS / "README.md"
REWRITES_README = ROOT / "rlflow" / "rewrites" / "README.md"


def _load_generator():
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "benchmarks" / "results_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results_index = _load_generator()

README_MAX_LINES, README_MAX_WIDTH = 120, 160
"""The README says what rlflow is, how to run it and where to read more; the rest lives under docs/ (issue #80)."""

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
    return [README, REWRITES_README] + sorted(DOCS.rglob("*.md"))


def folders_to_index() -> set[Path]:
    """Every directory under docs/results/, not hidden folders nor `__pycache__`."""
    return {path.resolve() for path in results_index.folders(RESULTS)}


def indexed_folders(index: Path = INDEX) -> set[Path]:
    targets = (local_target(index, t) for t in links(index.read_text(encoding="utf-8")))
    return {t for t in targets if t is not None and t.is_dir()}


def test_the_readme_is_short():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    wide = [n for n, line in enumerate(text.splitlines(), 1) if len(line) > README_MAX_WIDTH]
    assert not wide, f"README.md lines {wide} are over {README_MAX_WIDTH} characters"


def test_every_relative_link_in_the_readme_and_docs_leads_somewhere():
    assert broken_links(pages()) == []


def test_the_results_index_lists_every_results_folder():
    missing = folders_to_index() - indexed_folders()
    assert sorted(str(p.relative_to(RESULTS)) for p in missing) == []


def test_every_results_folder_has_a_complete_manifest():
    incomplete = {}
    for folder in results_index.folders(RESULTS):
        path = folder / results_index.MANIFEST
        name = str(folder.relative_to(RESULTS))
        if not path.is_file():
            incomplete[name] = ["no manifest.json"]
        elif found := results_index.problems(json.loads(path.read_text(encoding="utf-8"))):
            incomplete[name] = found
    assert incomplete == {}


def test_the_top_folders_runs_name_their_files():
    runs = results_index.top_runs(RESULTS)
    assert runs, "docs/results/manifest.json lists the runs whose files lie at the top"
    for run in runs:
        assert results_index.problems(run) == [], run["files"]
        assert run["files"] and all((RESULTS / f).is_file() for f in run["files"]), run["files"]
    listed = {f for run in runs for f in run["files"]}
    index_files = {"README.md", results_index.MANIFEST, results_index.REMOVED}
    unlisted = {p.name for p in RESULTS.iterdir() if p.is_file()} - listed - index_files
    assert unlisted == set(), "a file at the top of docs/results/ belongs to a run of its manifest.json"


def test_the_results_index_is_what_the_generator_writes(tmp_path):
    written = tmp_path / "README.md"
    assert results_index.main(["--results", str(RESULTS), "--out", str(written)]) == 0
    assert INDEX.read_text(encoding="utf-8") == written.read_text(encoding="utf-8"), \
        "docs/results/README.md is stale: run `make results-index`"


def test_every_removed_run_names_a_commit_and_is_gone():
    removed = results_index.removed(RESULTS)
    assert removed
    for run in removed:
        assert re.fullmatch(r"[0-9a-f]{7,40}", run["commit"]), run
        assert not (RESULTS / run["path"]).exists(), f"{run['path']} is listed as removed but is still there"
    text = INDEX.read_text(encoding="utf-8")
    assert all(f"git checkout {run['commit']} -- docs/results/{run['path'].rstrip('/')}`" in text for run in removed)


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
    for folder in ("a/b", "c", "a/__pycache__"):
        (results / folder).mkdir(parents=True)
    index = results / "README.md"
    index.write_text("- [a/](a/)\n- [a/b/](a/b/)\n")
    monkeypatch.setattr(sys.modules[__name__], "RESULTS", results)
    missing = folders_to_index() - indexed_folders(index)
    assert missing == {(results / "c").resolve()}  # a/__pycache__ is no results folder


def test_the_generator_refuses_a_folder_without_a_complete_manifest(tmp_path):
    import pytest

    complete = {"date": "2026-12-01", "commit": "abc1234", "machine": "CPU", "command": "rlflow bench x",
                "question": "q?", "status": "current"}
    (tmp_path / "run" / "part").mkdir(parents=True)
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(complete))
    with pytest.raises(SystemExit, match="no manifest.json in: run/part"):
        results_index.render(tmp_path)
    (tmp_path / "run" / "part" / "manifest.json").write_text(json.dumps({**complete, "status": "done"}))
    with pytest.raises(SystemExit, match="run/part: status 'done'"):
        results_index.render(tmp_path)
    assert results_index.problems({**complete, "commit": ""}) == ["no 'commit'"]
    (tmp_path / "run" / "part" / "manifest.json").write_text(json.dumps(complete))
    text = results_index.render(tmp_path)
    assert "| [run/part/](run/part/) | 2026-12-01 | `abc1234` | CPU | q? | rlflow bench x | current |" in text

