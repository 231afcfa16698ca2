"""Greedy on the held-out six before (e5cfd39) its screening measured the base in several sessions, with the base in
4 sessions in the first batch (737ddd3) and in 6 (06cbfd6, "after"), seeds 0-2: per model the median speedup over the
seeds [lowest, highest], the median search seconds, how many runs rewrote as before did, and the geometric mean of the
medians.  Before and four-sessions ran back to back per seed; after ran 25 minutes later on the same quiet machine.

    python docs/results/archive/decoders/session-spread/encoders/table.py

Each folder <version>-seed<N>/: `rlflow bench <six> --methods greedy --threads 1 --rounds 12 --seed N` (the six:
models/{bert-l2-h128,bert-l4-h256,minilm-l12-h384}-s16-{ts,dynamo}.onnx).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).parent
VERSIONS = ("before", "four-sessions", "after")


def rows(version: str) -> dict[str, list[dict]]:
    by_model: dict[str, list[dict]] = {}
    for folder in sorted(HERE.glob(f"{version}-seed*")):
        for row in json.loads((folder / "results.json").read_text())["rows"]:
            if row["method"] == "greedy" and row["status"] == "ok":
                by_model.setdefault(row["model"], []).append(row)
    return by_model


if __name__ == "__main__":
    data = {version: rows(version) for version in VERSIONS}
    print("| model | " + " | ".join(f"{v}: speedup, median [range] | search s | same rewrites" for v in VERSIONS) + " |")
    print("| --- |" + " --- | ---: | ---: |" * len(VERSIONS))
    medians: dict[str, list[float]] = {v: [] for v in VERSIONS}
    for model, before in data["before"].items():
        cells = []
        for version in VERSIONS:
            runs = data[version][model]
            speedups = [r["speedup"] for r in runs]
            medians[version].append(statistics.median(speedups))
            same = sum(sorted(r["rewrites"]) == sorted(b["rewrites"]) for r, b in zip(runs, before))
            cells.append(f"{statistics.median(speedups):.3f} [{min(speedups):.3f}, {max(speedups):.3f}] | "
                         f"{statistics.median(r['search_seconds'] for r in runs):.1f} | {same} of {len(runs)}")
        print(f"| {model} | {' | '.join(cells)} |")
    print("\ngeometric mean of the medians: " + ", ".join(
        f"{v} {math.exp(statistics.fmean(math.log(m) for m in medians[v])):.3f}" for v in VERSIONS))
