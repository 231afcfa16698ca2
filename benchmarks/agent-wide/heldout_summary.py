"""The held-out bench of `make agent-wide` (issue #49's CPU target) as heldout.md: per held-out export, the wide
agent's (seed 1), greedy's, TASO-style search's and the shipped agent's speedup and time, and the target's checks.

    python benchmarks/agent-wide/heldout_summary.py

Some of its inputs left the tree with issue #80 (git keeps them): `git checkout c3883d3 --
docs/results/agent-wide/heldout docs/results/agent-wide/heldout-default docs/results/agent-wide/heldout-taso` brings
them back.
"""
import json
import math
from pathlib import Path

here = Path(__file__).resolve().parents[2] / "docs" / "results" / "agent-wide"


def rows(folder: str) -> dict:
    path = here / folder / "results.json"
    if not path.exists():
        return {}
    return {(r["model"], r["method"]): r for r in json.loads(path.read_text())["rows"]}


wide, default, taso = rows("heldout"), rows("heldout-default"), rows("heldout-taso")
models = sorted({m for m, _ in wide})


def cell(row) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return f"{row['status']}"
    return f"{row['speedup']:.3f} [{row['speedup_low']:.3f}, {row['speedup_high']:.3f}] in {row['seconds']:.0f} s"


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


lines = ["# `make agent-wide`'s agent on the held-out exports (issue #49, CPU, 1 thread)", "",
         "Written by `python benchmarks/agent-wide/heldout_summary.py` from `heldout/` (the wide agent, seed 1, and "
         "greedy; `rlflow bench <twelve> --methods agent,greedy --agent build/agent-wide/run1/worldmodel.pt --threads 1 "
         "--rounds 12`), `heldout-taso/` (TASO-style search, `--methods taso`) and `heldout-default/` (the shipped agent, "
         "`--methods agent`), each run on its own on the quiet machine. Each method at its defaults; "
         "speedup: the bench's interleaved measurement of the output against the input, median [interval]; time: the "
         "whole `optimize` call.", "",
         "| held-out export | wide agent (seed 1) | greedy | TASO-style | shipped agent |",
         "| --- | --- | --- | --- | --- |"]
ok = lambda row: row is not None and row["status"] == "ok"  # noqa: E731
series = {"wide": [], "greedy": [], "taso": [], "default": []}
times = {"wide": [], "greedy": [], "taso": [], "default": []}
behind, gains = [], 0
for model in models:
    a, g, d = wide.get((model, "agent")), wide.get((model, "greedy")), default.get((model, "agent"))
    t = taso.get((model, "taso"))
    lines.append(f"| {model} | {cell(a)} | {cell(g)} | {cell(t)} | {cell(d)} |")
    if ok(a) and ok(g) and ok(d) and ok(t):
        for key, row in (("wide", a), ("greedy", g), ("taso", t), ("default", d)):
            series[key].append(row["speedup"])
            times[key].append(row["seconds"])
        if g["speedup"] > 1.0:
            gains += 1
            if a["speedup"] < 0.99 * g["speedup"]:
                behind.append(model)
n = len(series["wide"])
best_peer = max(geomean(series["greedy"]), geomean(series["taso"]))
lines += ["", f"Over the {n} exports all four ran on: geomean speedup wide agent {geomean(series['wide']):.3f}, greedy "
          f"{geomean(series['greedy']):.3f}, TASO-style {geomean(series['taso']):.3f}, shipped agent "
          f"{geomean(series['default']):.3f}; total time wide agent {sum(times['wide']):.0f} s, greedy "
          f"{sum(times['greedy']):.0f} s (ratio {sum(times['wide']) / max(sum(times['greedy']), 1e-9):.2f}), "
          f"TASO-style {sum(times['taso']):.0f} s, shipped agent {sum(times['default']):.0f} s.",
          "", "- Wide agent's geomean at least greedy's and TASO-style's (within 0.005): "
          f"{'holds' if geomean(series['wide']) >= best_peer - 0.005 else 'no'}.",
          f"- Never behind greedy by more than 1% where greedy gains ({gains} exports): "
          + ("holds" if not behind else f"no: behind on {len(behind)} ({', '.join(behind)})") + ".",
          f"- In at most a third of greedy's time: {'holds' if sum(times['wide']) <= sum(times['greedy']) / 3 else 'no'}."]
(here / "heldout.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
