"""Greedy on the held-out six, three seeds (0, 1, 2) for each of four versions of it: per model the median speedup
over the seeds with their range, each version's median search time, and the geometric mean of the medians.

    python docs/results/agent-deploy/greedy-kinds/compare.py

Versions (folders <version>-seed<N>/, each `rlflow bench <six> --methods greedy --threads 1 --rounds 12 --seed N`):
old (0a67d17: every single rewrite in the last phase), confirm-all (40c2192: each kind of location, no measuring
again what an earlier step refused, and a second measurement before every step), confirm-several (ab99e73: the
second measurement only for a candidate chosen among several), current (d81f98f: no second measurement).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).parent
VERSIONS = ("old", "confirm-all", "confirm-several", "current")


def rows(version: str) -> dict[str, list[dict]]:
    by_model: dict[str, list[dict]] = {}
    for folder in sorted(HERE.glob(f"{version}-seed*")):
        for row in json.loads((folder / "results.json").read_text())["rows"]:
            if row["method"] == "greedy" and row["status"] == "ok":
                by_model.setdefault(row["model"], []).append(row)
    return by_model


def main() -> None:
    data = {version: rows(version) for version in VERSIONS}
    print("| model | " + " | ".join(f"{v}: speedup, median [range] | search s" for v in VERSIONS) + " |")
    print("| --- |" + " --- | ---: |" * len(VERSIONS))
    medians: dict[str, list[float]] = {v: [] for v in VERSIONS}
    for model in data["old"]:
        cells = []
        for version in VERSIONS:
            speedups = [r["speedup"] for r in data[version][model]]
            seconds = statistics.median(r["search_seconds"] for r in data[version][model])
            medians[version].append(statistics.median(speedups))
            cells.append(f"{statistics.median(speedups):.3f} [{min(speedups):.3f}, {max(speedups):.3f}] | {seconds:.1f}")
        print(f"| {model} | {' | '.join(cells)} |")
    print("\ngeometric mean of the medians: " + ", ".join(
        f"{v} {math.exp(statistics.fmean(math.log(m) for m in medians[v])):.3f}" for v in VERSIONS))


if __name__ == "__main__":
    main()
