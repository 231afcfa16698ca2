"""The shipped agent, greedy and TASO-style search on the eighteen held-out exports, their outputs of a model measured
together, one bench per seed (issue #49's CPU target): writes summary.md in the run folder (this one by default;
../joint-as-run/ is the run with outputs grouped as onnxruntime runs them, without TASO-style search).

    python docs/results/agent-wide/joint/summary.py [FOLDER]
"""
import json
import math
import sys
from pathlib import Path

here = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parent
runs = {p.parent.name: json.loads(p.read_text()) for p in sorted(here.glob("seed*/results.json"))}
METHODS = tuple(m for m in ("agent", "greedy", "taso")
                if any(r["method"] == m for results in runs.values() for r in results["rows"]))
NAMES = {"agent": "agent", "greedy": "greedy", "taso": "TASO-style"}
SIX = {f"{a}-s16-{e}" for a in ("bert-l2-h128", "bert-l4-h256", "minilm-l12-h384") for e in ("ts", "dynamo")}


def table(results: dict) -> dict:
    return {(r["model"], r["method"]): r for r in results["rows"]}


tables = {seed: table(results) for seed, results in runs.items()}
models = list(dict.fromkeys(r["model"] for results in runs.values() for r in results["rows"]))


def ok(row) -> bool:
    return row is not None and row["status"] == "ok"


def figure(row) -> str:
    if not ok(row):
        return row["status"] if row else "-"
    text = f"{row['speedup']:.3f}"
    text = f"**{text}**" if row["faster"] else text
    as_run = " as run" if row.get("same_as_run") else ""
    return text + (f" (= {row['same_output_as']}{as_run})" if row.get("same_output_as") else "")


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def same_graph(agent: dict, greedy: dict) -> bool:
    """The agent's and greedy's outputs were one graph (measured once), or both kept the input."""
    return "agent" == greedy["same_output_as"] or "greedy" == agent["same_output_as"] or not (
        agent["rewritten"] or greedy["rewritten"])


def checks(rows: dict, chosen: list[str]) -> dict:
    speed = {m: [] for m in METHODS}
    secs = {m: [] for m in METHODS}
    behind, gains, same = [], 0, 0
    for model in chosen:
        got = {m: rows.get((model, m)) for m in METHODS}
        if not all(ok(r) for r in got.values()):
            continue
        for m, r in got.items():
            speed[m].append(r["speedup"])
            secs[m].append(r["seconds"])
        a, g = got["agent"], got["greedy"]
        same += same_graph(a, g)
        if g["speedup"] > 1.0:
            gains += 1
            behind += [model] if a["speedup"] < 0.99 * g["speedup"] else []
    means = {m: geomean(v) for m, v in speed.items()}
    return {"n": len(speed["agent"]), "geomean": means, "seconds": {m: sum(v) for m, v in secs.items()},
            "time_ratio": sum(secs["agent"]) / max(sum(secs["greedy"]), 1e-9), "behind": behind, "gains": gains,
            "same": same, "geomean_holds": means["agent"] >= max(v for m, v in means.items() if m != "agent") - 0.005}


def part(title: str, chosen: list[str]) -> list[str]:
    seeds = list(tables)
    head = " | ".join(f"{NAMES[m]} ({', '.join(seeds)})" for m in METHODS)
    lines = [f"## {title}", "", f"| export | {head} |", "| --- |" + " --- |" * len(METHODS)]
    for model in chosen:
        cells = [" / ".join(figure(tables[s].get((model, m))) for s in seeds) for m in METHODS]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    names = ", ".join(NAMES[m] for m in METHODS)
    lines += ["", f"| seed | {' | '.join(NAMES[m] for m in METHODS)} | whole runs: {names} (agent/greedy) "
              "| agent's graph greedy's (or as run) | agent behind greedy by over 1% where greedy gains |",
              "| --- |" + " ---: |" * len(METHODS) + " --- | ---: | --- |"]
    for seed, rows in tables.items():
        c = checks(rows, chosen)
        g, t = c["geomean"], c["seconds"]
        lines.append(f"| {seed} | " + " | ".join(f"{g[m]:.3f}" for m in METHODS) + " | "
                     + ", ".join(f"{t[m]:.0f} s" for m in METHODS) + f" ({c['time_ratio']:.2f}) | {c['same']} of "
                     f"{c['n']} | {len(c['behind'])} of {c['gains']}: {', '.join(c['behind']) or 'none'} |")
    every = [checks(rows, chosen) for rows in tables.values()]
    lines += ["", f"- Agent's geomean at least {' and '.join(NAMES[m] + chr(39) + 's' for m in METHODS[1:])} "
              "(within 0.005): on "
              f"{sum(c['geomean_holds'] for c in every)} of {len(every)} seeds.",
              f"- Never behind greedy by more than 1% where greedy gains: on "
              f"{sum(not c['behind'] for c in every)} of {len(every)} seeds.",
              f"- In at most a third of greedy's time: on {sum(c['time_ratio'] <= 1 / 3 for c in every)} of "
              f"{len(every)} seeds; in at most half (the restatement): on "
              f"{sum(c['time_ratio'] <= 1 / 2 for c in every)}.", ""]
    return lines


first = next(iter(runs.values()))
env = first["environment"]
lines = [f"# The shipped agent against {' and '.join(NAMES[m] for m in METHODS[1:])}, held out, measured together "
         "(issue #49, CPU)", "",
         f"Written by `python docs/results/agent-wide/joint/summary.py{' ' + sys.argv[1] if len(sys.argv) > 1 else ''}` from `seed*/results.json` (commit "
         f"{env.get('commit') or '?'}, {env['cpu']}, 1 thread, {first['config']['rounds']} rounds, bench seeds "
         f"{', '.join(str(r['config']['seed']) for r in runs.values())}). Each method at its defaults; speedup: the "
         "bench's interleaved measurement of the outputs against the input, the methods' outputs of a model in "
         "the same rounds, a graph two methods wrote measured once (`= greedy`; `as run`: the same once onnxruntime "
         "has optimised both, where the bench groups them so); **bold** where the interval lies "
         "above 1; time: the whole `optimize` call. Intervals are in each seed's `results.md`.", ""]
lines += part("Held-out families and export styles (the twelve)", [m for m in models if m not in SIX])
lines += part("Held-out BERT exports of the trained styles (the six)", [m for m in models if m in SIX])
(here / "summary.md").write_text("\n".join(lines))
print("\n".join(lines))
