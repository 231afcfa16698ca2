"""The shipped agent, greedy and TASO-style search on the eighteen held-out exports, their outputs of a model measured
together, one bench per seed (issue #49's CPU target): writes summary.md beside this file.

    python docs/results/agent-wide/joint/summary.py
"""
import json
import math
from pathlib import Path

here = Path(__file__).resolve().parent
runs = {p.parent.name: json.loads(p.read_text()) for p in sorted(here.glob("seed*/results.json"))}
METHODS = ("agent", "greedy", "taso")
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
    return text + (f" (= {row['same_output_as']})" if row.get("same_output_as") else "")


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
            "same": same, "geomean_holds": means["agent"] >= max(means["greedy"], means["taso"]) - 0.005}


def part(title: str, chosen: list[str]) -> list[str]:
    seeds = list(tables)
    head = " | ".join(f"{m} ({', '.join(seeds)})" for m in ("agent", "greedy", "TASO-style"))
    lines = [f"## {title}", "", f"| export | {head} |", "| --- | --- | --- | --- |"]
    for model in chosen:
        cells = [" / ".join(figure(tables[s].get((model, m))) for s in seeds) for m in METHODS]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += ["", "| seed | agent | greedy | TASO-style | whole runs: agent, greedy, TASO-style (agent/greedy) "
              "| agent's graph greedy's | agent behind greedy by over 1% where greedy gains |",
              "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for seed, rows in tables.items():
        c = checks(rows, chosen)
        g, t = c["geomean"], c["seconds"]
        lines.append(f"| {seed} | {g['agent']:.3f} | {g['greedy']:.3f} | {g['taso']:.3f} | {t['agent']:.0f} s, "
                     f"{t['greedy']:.0f} s, {t['taso']:.0f} s ({c['time_ratio']:.2f}) | {c['same']} of {c['n']} | "
                     f"{len(c['behind'])} of {c['gains']}: {', '.join(c['behind']) or 'none'} |")
    every = [checks(rows, chosen) for rows in tables.values()]
    lines += ["", f"- Agent's geomean at least greedy's and TASO-style's (within 0.005): on "
              f"{sum(c['geomean_holds'] for c in every)} of {len(every)} seeds.",
              f"- Never behind greedy by more than 1% where greedy gains: on "
              f"{sum(not c['behind'] for c in every)} of {len(every)} seeds.",
              f"- In at most a third of greedy's time: on {sum(c['time_ratio'] <= 1 / 3 for c in every)} of "
              f"{len(every)} seeds; in at most half (the restatement): on "
              f"{sum(c['time_ratio'] <= 1 / 2 for c in every)}.", ""]
    return lines


first = next(iter(runs.values()))
env = first["environment"]
lines = ["# The shipped agent against greedy and TASO-style search, held out, measured together (issue #49, CPU)", "",
         f"Written by `python docs/results/agent-wide/joint/summary.py` from `seed*/results.json` (commit "
         f"{env.get('commit') or '?'}, {env['cpu']}, 1 thread, {first['config']['rounds']} rounds, bench seeds "
         f"{', '.join(str(r['config']['seed']) for r in runs.values())}). Each method at its defaults; speedup: the "
         "bench's interleaved measurement of the outputs against the input, the three methods' outputs of a model in "
         "the same rounds, a graph two methods wrote measured once (`= greedy`); **bold** where the interval lies "
         "above 1; time: the whole `optimize` call. Intervals are in each seed's `results.md`.", ""]
lines += part("Held-out families and export styles (the twelve)", [m for m in models if m not in SIX])
lines += part("Held-out BERT exports of the trained styles (the six)", [m for m in models if m in SIX])
(here / "summary.md").write_text("\n".join(lines))
print("\n".join(lines))
