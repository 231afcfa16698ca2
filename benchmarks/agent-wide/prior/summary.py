"""The held-out bench with the fuse-everything graph among the agent's candidates (issue #49's CPU target) as
README.md's tables: per held-out export, the wide agent over its four seeds (median [range]), the shipped agent,
greedy (`greedy/`) and TASO-style search (`../heldout-taso/`, its code unchanged since), and how many agent outputs
were the fuse-everything graph; then the target's checks per agent.

    python benchmarks/agent-wide/prior/summary.py [FOLDER]

FOLDER (default: this one) holds the agents' runs (`seedN/`, `shipped/`, `six-shipped-seedN/`); greedy's are this
folder's `greedy/` either way.

Some of its inputs left the tree with issue #80 (git keeps them): `git checkout c3883d3 --
docs/results/agent-wide/prior docs/results/agent-wide/heldout-taso docs/results/agent-deploy/greedy-kinds` brings
them back.
"""
import json
import math
import statistics
import sys
from pathlib import Path

here = Path(__file__).resolve().parents[3] / "docs" / "results" / "agent-wide" / "prior"
runs = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else here
SEEDS = (0, 1, 2, 3)
FUSED = "(the fuse-everything graph"


def rows(folder: Path) -> dict:
    path = folder / "results.json"
    if not path.exists():
        return {}
    return {(r["model"], r["method"]): r for r in json.loads(path.read_text())["rows"] if r["status"] == "ok"}


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def cell(row) -> str:
    return "-" if row is None else f"{row['speedup']:.3f} in {row['seconds']:.0f} s"


seeds = {s: rows(runs / f"seed{s}") for s in SEEDS}
shipped, taso = rows(runs / "shipped"), rows(here.parent / "heldout-taso")
greedy = {m: r for (m, method), r in rows(here / "greedy").items() if method == "greedy"}
models = sorted(greedy)
agents = {s: {m: seeds[s].get((m, "agent")) for m in models} for s in SEEDS}
fused_wins = {s: sum(FUSED in (r or {}).get("search_stop", "") for r in agents[s].values()) for s in SEEDS}

lines = ["| held-out export | wide agent, 4 seeds: median [range] | of them fuse-everything | shipped agent | greedy "
         "| TASO-style |", "| --- | --- | ---: | --- | --- | --- |"]
for m in models:
    speeds = [agents[s][m]["speedup"] for s in SEEDS if agents[s][m]]
    fused = sum(FUSED in agents[s][m].get("search_stop", "") for s in SEEDS if agents[s][m])
    spread = (f"{statistics.median(speeds):.3f} [{min(speeds):.3f}, {max(speeds):.3f}]" if speeds else "-")
    lines.append(f"| {m} | {spread} | {fused} | {cell(shipped.get((m, 'agent')))} | {cell(greedy[m])} "
                 f"| {cell(taso.get((m, 'taso')))} |")

g_mean, t_mean = geomean([greedy[m]["speedup"] for m in models]), geomean([taso[(m, "taso")]["speedup"]
                                                                            for m in models if (m, "taso") in taso])
g_time = sum(greedy[m]["seconds"] for m in models)
lines += ["", f"Greedy {g_mean:.3f} in {g_time:.0f} s in all; TASO-style {t_mean:.3f}.", "",
          "| agent | geomean | total time (of greedy's) | behind greedy by more than 1% where greedy gains "
          "| outputs that were the fuse-everything graph |", "| --- | ---: | ---: | --- | ---: |"]
gains = [m for m in models if greedy[m]["speedup"] > 1.0]
means = []
for name, found in [(f"wide seed {s}", agents[s]) for s in SEEDS] + [("shipped", {m: shipped.get((m, "agent"))
                                                                                   for m in models})]:
    if not all(found.values()):
        lines.append(f"| {name} | missing | | | |")
        continue
    mean, seconds = geomean([found[m]["speedup"] for m in models]), sum(found[m]["seconds"] for m in models)
    behind = [m for m in gains if found[m]["speedup"] < 0.99 * greedy[m]["speedup"]]
    wins = sum(FUSED in r.get("search_stop", "") for r in found.values())
    if name.startswith("wide"):
        means.append(mean)
    lines.append(f"| {name} | {mean:.3f} | {seconds:.0f} s ({seconds / g_time:.2f}) | {len(behind)} of {len(gains)}"
                 f"{': ' + ', '.join(behind) if behind else ''} | {wins} |")
if means:
    lines += ["", f"Wide agent's geomean over its seeds: median {statistics.median(means):.3f} "
              f"[{min(means):.3f}, {max(means):.3f}]; at least greedy's and TASO-style's within 0.005 on "
              f"{sum(x >= max(g_mean, t_mean) - 0.005 for x in means)} of {len(means)} seeds."]
print("\n".join(lines))

# The held-out six: the shipped agent now, three seeds, beside greedy's three seeds of
# ../../agent-deploy/greedy-kinds/current-seedN (the same models and greedy code, run earlier the same day).
six_agent = [rows(runs / f"six-shipped-seed{s}") for s in range(3)]
six_greedy = [rows(here.parents[1] / "agent-deploy" / "greedy-kinds" / f"current-seed{s}") for s in range(3)]
if all(six_agent) and all(six_greedy):
    lines = ["", "| held-out six | shipped agent, 3 seeds: median [range] | search s | greedy, 3 seeds | search s |",
             "| --- | --- | ---: | --- | ---: |"]
    medians = {"agent": [], "greedy": []}
    for m in sorted({m for m, _ in six_agent[0]}):
        cells = []
        for key, found, method in (("agent", six_agent, "agent"), ("greedy", six_greedy, "greedy")):
            runs = [f[(m, method)] for f in found]
            speeds = [r["speedup"] for r in runs]
            medians[key].append(statistics.median(speeds))
            cells += [f"{statistics.median(speeds):.3f} [{min(speeds):.3f}, {max(speeds):.3f}]",
                      f"{statistics.median(r['search_seconds'] for r in runs):.1f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append(f"| **geometric mean of the medians** | **{geomean(medians['agent']):.3f}** | | "
                 f"**{geomean(medians['greedy']):.3f}** | |")
    print("\n".join(lines))
