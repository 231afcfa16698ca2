"""The index of docs/results/ (issue #80), written from the runs' manifests: nothing in it is edited by hand.

Every folder under docs/results/ holds a `manifest.json` saying when its run was made (the date and the commit that
last wrote it), on what machine, by what command, what question it answered and its status.  The top folder's
`manifest.json` lists the runs whose files lie at the top (their commands write there by default), each with its
`files`.  `removed.json` lists the runs that left the tree, each with the commit that still has it.  This script
writes docs/results/README.md from them:

    make results-index                               # python benchmarks/results_index.py
    python benchmarks/results_index.py --out PATH    # somewhere else (the docs test compares the two)

A folder without a manifest stops it: write the manifest with the run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
MANIFEST = "manifest.json"
REMOVED = "removed.json"

KEYS = ("date", "commit", "machine", "command", "question", "status")
"""What every manifest (and every entry of the top folder's `runs`) says."""

STATUSES = ("current", "superseded", "invalid")
"""`current`: the run holds for the code as it is.  A run a doc still cites as history is kept with `superseded` or
`invalid` and a `note` saying by what, or why."""

SECTIONS = ("The agent (issue #28)", "The CUDA agent (issue #49)",
            "The CPU agent on a wider set of exports (issue #49)", "Decoders (issue #50)", "The deployment section and the zoo", "CUDA", "Reduced precision (issue #77)")
"""The order of the index's sections; a manifest names its own (`section`), others follow in alphabetical order."""

OTHER = "Other runs"
TOP = "Files at the top of this folder"

INTRO = """\
Every run that the [README](../../README.md), a page of [docs/](../),
[rlflow/rewrites/README.md](../../rlflow/rewrites/README.md) or a Makefile target cites, one line per folder: the date
and the commit that last wrote it, the machine, the question it answered, the command that made it, and its status
(*current*; *superseded* or *invalid* where a page still cites it as history). Runs that left the tree are
[listed at the end](#removed-runs) with the command that brings each back. The scripts that made or summarise a run
are in [benchmarks/](../../benchmarks/), under the run's own path. Every run was on the CPU with 1 intra-op thread
unless it says otherwise; the held-out six are BERT L2/H128, L4/H256 and MiniLM-L12/H384 at sequence 16, each
TorchScript and dynamo.

This page is written by `make results-index` (benchmarks/results_index.py) from each folder's `manifest.json`, the
top folder's `manifest.json` and `removed.json`: edit those, not this page."""


def folders(results: Path = RESULTS) -> list[Path]:
    """Every folder under `results`, not hidden ones nor `__pycache__`."""
    return sorted(p for p in results.rglob("*")
                  if p.is_dir() and not any(part.startswith((".", "__")) for part in p.relative_to(results).parts))


def manifests(results: Path = RESULTS) -> dict[str, dict]:
    """Folder (relative to `results`, POSIX) -> its manifest; a folder without one is an error."""
    found, missing = {}, []
    for folder in folders(results):
        path = folder / MANIFEST
        if path.is_file():
            found[folder.relative_to(results).as_posix()] = json.loads(path.read_text(encoding="utf-8"))
        else:
            missing.append(folder.relative_to(results).as_posix())
    if missing:
        raise SystemExit(f"no {MANIFEST} in: {', '.join(missing)}")
    return found


def top_runs(results: Path = RESULTS) -> list[dict]:
    path = results / MANIFEST
    return json.loads(path.read_text(encoding="utf-8"))["runs"] if path.is_file() else []


def removed(results: Path = RESULTS) -> list[dict]:
    path = results / REMOVED
    return json.loads(path.read_text(encoding="utf-8"))["removed"] if path.is_file() else []


def problems(manifest: dict) -> list[str]:
    """What a manifest lacks: a required key, or a status outside STATUSES."""
    found = [f"no {key!r}" for key in KEYS if not str(manifest.get(key, "")).strip()]
    if manifest.get("status") not in STATUSES:
        found.append(f"status {manifest.get('status')!r} is not one of {', '.join(STATUSES)}")
    return found


def _parts(name: str) -> list[str]:
    return name.split("/")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _status(manifest: dict) -> str:
    note = manifest.get("note", "")
    if not note or note == manifest["status"]:
        return manifest["status"]
    return note if note.lstrip("*").lower().startswith(manifest["status"]) else f"{manifest['status']}: {note}"


def _date(manifest: dict) -> str:
    made = manifest.get("made")
    return f"{manifest['date']} (made {made})" if made and made != manifest["date"] else manifest["date"]


def _row(link: str, manifest: dict) -> str:
    cells = [link, _date(manifest), f"`{manifest['commit']}`", manifest["machine"], manifest["question"],
             manifest["command"], _status(manifest)]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


HEADER = ["| folder | date | commit | machine | question | command | status |", "| --- | --- | --- | --- | --- | --- | --- |"]


def render(results: Path = RESULTS) -> str:
    """The index's text."""
    runs = manifests(results)
    bad = {name: found for name, m in runs.items() if (found := problems(m))}
    for run in top_runs(results):
        if found := problems(run):
            bad[f"top: {', '.join(run.get('files', []))}"] = found
    if bad:
        raise SystemExit("manifests incomplete: " + "; ".join(f"{n}: {', '.join(p)}" for n, p in sorted(bad.items())))
    by_section: dict[str, list[str]] = {}
    for name, manifest in runs.items():
        by_section.setdefault(manifest.get("section") or OTHER, []).append(name)
    order = [s for s in SECTIONS if s in by_section] + sorted(s for s in by_section if s not in SECTIONS)
    lines = ["# Results", "", INTRO]
    for section in order:
        lines += ["", f"## {section}", "", *HEADER]
        lines += [_row(f"[{name}/]({name}/)", runs[name]) for name in sorted(by_section[section], key=_parts)]
    if top := top_runs(results):
        lines += ["", f"## {TOP}", "", "Their commands write here by default, so they stay here.", "",
                  "| files | date | commit | machine | question | command | status |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for run in top:
            first, *others = run["files"]
            link = f"[{first}]({first})" + (f" ({', '.join(f'`{f}`' for f in others)})" if others else "")
            lines.append(_row(link, run))
    if gone := removed(results):
        lines += ["", "## Removed runs", "",
                  "Superseded runs and runs no page cites left the tree with issue #80; git keeps them. Each line is a",
                  "folder (with the folders inside it) or a file, what it answered, its status then, and the command",
                  "that brings it back.", "",
                  "| folder | made | question | status then | bring it back |", "| --- | --- | --- | --- | --- |"]
        for run in gone:
            inside = run.get("folders_inside")
            name = f"`{run['path']}`" + (f" ({inside} folders inside)" if inside else "")
            cells = [name, run.get("made", ""), run.get("question", ""), run.get("was", ""),
                     f"`git checkout {run['commit']} -- docs/results/{run['path'].rstrip('/')}`"]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder (docs/results)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the index (RESULTS/README.md)")
    args = parser.parse_args(argv)
    out = args.out or args.results / "README.md"
    out.write_text(render(args.results), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
