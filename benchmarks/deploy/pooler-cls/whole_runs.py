"""Issue #49's time target against the whole runs a user waits for: per encoder export, the agent's and greedy's
whole `rlflow optimize` run (search, verification, final measurement), and the part of the agent's run that is not
its search.  Where that part alone is more than a third of greedy's whole run, no search however quick meets "a third
of greedy's wall time" on that model.

    python benchmarks/deploy/pooler-cls/whole_runs.py run2/encoders [run3/encoders ...] > whole-runs.md

Some of its inputs left the tree with issue #80 (git keeps them): `git checkout c3883d3 --
docs/results/deploy/pooler-cls/run2 docs/results/deploy/pooler-cls/run3` brings them back.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[3] / "docs" / "results" / "deploy" / "pooler-cls"


def _runs(folder: str) -> dict[str, dict[str, dict]]:
    rows: dict[str, dict[str, dict]] = {}
    for row in json.loads((HERE / folder / "results.json").read_text())["rows"]:
        if row["method"] in ("agent", "greedy") and row["status"] == "ok":
            rows.setdefault(row["model"], {})[row["method"]] = row
    return {model: pair for model, pair in rows.items() if len(pair) == 2}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def table(folder: str) -> list[str]:
    runs = _runs(folder)
    lines = [f"## {folder}", "",
             "| model | agent whole (s) | agent outside its search (s) | greedy whole (s) | a third of greedy's | "
             "agent / greedy |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ratios, bound, slower = [], 0, 0
    for model in sorted(runs):
        agent, greedy = runs[model]["agent"], runs[model]["greedy"]
        outside = agent["seconds"] - agent["search_seconds"]
        ratio = agent["seconds"] / greedy["seconds"]
        ratios.append(ratio)
        bound += outside > greedy["seconds"] / 3
        slower += ratio > 1
        lines.append(f"| {model} | {agent['seconds']:.1f} | {outside:.1f} | {greedy['seconds']:.1f} | "
                     f"{greedy['seconds'] / 3:.1f} | {ratio:.2f} |")
    mean = (sum(runs[m]["agent"]["seconds"] for m in runs) / sum(runs[m]["greedy"]["seconds"] for m in runs))
    lines += ["", f"{len(runs)} models: the agent's run outside its search exceeds a third of greedy's whole run on "
              f"{bound}; the agent's whole run is longer than greedy's on {slower}; agent / greedy {mean:.2f} on the "
              f"mean whole run, {_geomean(ratios):.2f} geometric mean of the per-model ratios, "
              f"{min(ratios):.2f}-{max(ratios):.2f}.", ""]
    return lines


def main() -> None:
    folders = sys.argv[1:] or ["run2/encoders"]
    print("# Whole runs: the agent against greedy (issue #49's time target)\n")
    print(__doc__.split("\n\n")[0].replace("\n", " ") + "\n")
    for folder in folders:
        print("\n".join(table(folder)))


if __name__ == "__main__":
    main()
