"""The decoders' target table from `rlflow bench` results folders: per model, greedy's speedup, the best peer's, the
peers measurably faster, the builder's graph, and whether issue #50's CPU target holds (rlflow's median at least the
best peer's, or its interval reaching it, and slower at no profile).

    python benchmarks/decoders/bench_table.py FOLDER [FOLDER...]
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def _ratio(row: dict) -> str:
    text = f"{row['speedup']:.3f} [{row['speedup_low']:.3f}, {row['speedup_high']:.3f}]"
    return f"**{text}**" if row["speedup_low"] > 1 else text


def _slower_at(row: dict) -> list[str]:
    profiles = row.get("profiles") or []
    profiles = ast.literal_eval(profiles) if isinstance(profiles, str) else profiles
    return [p["label"] for p in profiles if p["speedup_high"] < 1]


def table(folder: Path) -> list[str]:
    results = json.loads((folder / "results.json").read_text())
    fixed = results["config"].get("fix_dims") or {}
    batch = "1" if fixed.get("batch") == 1 else "dynamic"
    rows: dict[str, dict[str, dict]] = {}
    for row in results["rows"]:
        rows.setdefault(row["model"], {})[row["method"]] = row
    lines = []
    for model, methods in rows.items():
        greedy = methods.get("greedy")
        peers = [r for r in methods.values() if r.get("kind") == "peer" and r["status"] == "ok"]
        best = max(peers, key=lambda r: r["speedup"]) if peers else None
        faster = [r["method"] for r in peers if r["speedup_low"] > 1]
        builder = methods.get("genai-builder")
        if greedy is None or greedy["status"] != "ok":
            lines.append(f"| {model} | {batch} | {greedy['status'] if greedy else 'not run'} | | | | |")
            continue
        kept = "" if greedy["rewritten"] else " (input kept)"
        holds = best is None or greedy["speedup"] >= best["speedup"] or greedy["speedup_high"] >= best["speedup"]
        slower = _slower_at(greedy)
        verdict = "holds" if holds else "no as worded; no peer measurably faster" if not faster else "**no**"
        verdict += f"; slower at {', '.join(slower)}" if slower else ""
        lines.append(f"| {model} | {batch} | {_ratio(greedy)}{kept} | "
                     f"{best['method'] + ' ' + _ratio(best) if best else ''} | {', '.join(faster) or 'none'} | "
                     f"{_ratio(builder) if builder and builder['status'] == 'ok' else ''} | {verdict} |")
    return lines


def main(folders: list[str]) -> None:
    print("| step | batch | greedy | best peer | peers measurably faster | builder's graph | target |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for folder in folders:
        print("\n".join(table(Path(folder))))


if __name__ == "__main__":
    main(sys.argv[1:])
