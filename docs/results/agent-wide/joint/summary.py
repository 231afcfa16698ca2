"""The shipped agent, greedy and TASO-style search on the eighteen held-out exports in one bench, their outputs of a
model measured together (issue #49's CPU target): writes summary.md beside this file.

    python docs/results/agent-wide/joint/summary.py [FOLDER]
"""
import json
import math
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
results = json.loads((here / "results.json").read_text())
rows = {(r["model"], r["method"]): r for r in results["rows"]}
models = list(dict.fromkeys(r["model"] for r in results["rows"]))
SIX = {f"{a}-s16-{e}" for a in ("bert-l2-h128", "bert-l4-h256", "minilm-l12-h384") for e in ("ts", "dynamo")}


def cell(row) -> str:
    if row is None or row["status"] != "ok":
        return row["status"] if row else "-"
    same = f" (= {row['same_output_as']})" if row.get("same_output_as") else ""
    figure = f"{row['speedup']:.3f} [{row['speedup_low']:.3f}, {row['speedup_high']:.3f}]"
    return f"{'**' + figure + '**' if row['faster'] else figure}{same} in {row['seconds']:.0f} s"


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def part(title: str, chosen: list[str]) -> list[str]:
    lines = [f"## {title}", "", "| export | agent | greedy | TASO-style |", "| --- | --- | --- | --- |"]
    speed = {m: [] for m in ("agent", "greedy", "taso")}
    secs = {m: [] for m in speed}
    behind, gains, same = [], 0, 0
    for model in chosen:
        got = {m: rows.get((model, m)) for m in speed}
        lines.append(f"| {model} | " + " | ".join(cell(got[m]) for m in speed) + " |")
        if not all(r is not None and r["status"] == "ok" for r in got.values()):
            continue
        for m, r in got.items():
            speed[m].append(r["speedup"])
            secs[m].append(r["seconds"])
        a, g = got["agent"], got["greedy"]
        same += "greedy" in (a["same_output_as"], g["same_output_as"]) or "agent" in (a["same_output_as"], g["same_output_as"]) or not (a["rewritten"] or g["rewritten"])
        if g["speedup"] > 1.0:
            gains += 1
            if a["speedup"] < 0.99 * g["speedup"]:
                behind.append(model)
    n, ratio = len(speed["agent"]), sum(secs["agent"]) / max(sum(secs["greedy"]), 1e-9)
    best = max(geomean(speed["greedy"]), geomean(speed["taso"]))
    lines += ["", f"Over {n} exports: geomean agent {geomean(speed['agent']):.3f}, greedy "
              f"{geomean(speed['greedy']):.3f}, TASO-style {geomean(speed['taso']):.3f}; whole runs agent "
              f"{sum(secs['agent']):.0f} s, greedy {sum(secs['greedy']):.0f} s (agent/greedy {ratio:.2f}), TASO-style "
              f"{sum(secs['taso']):.0f} s. The agent's output was greedy's graph (or both kept the input) on {same} of "
              f"{n}.", "",
              "- Agent's geomean at least greedy's and TASO-style's (within 0.005): "
              f"{'holds' if geomean(speed['agent']) >= best - 0.005 else 'no'}.",
              f"- Never behind greedy by more than 1% where greedy gains ({gains} exports): "
              + ("holds" if not behind else f"no: behind on {len(behind)} ({', '.join(behind)})") + ".",
              f"- In at most a third of greedy's time: {'holds' if ratio <= 1 / 3 else 'no'} ({ratio:.2f}); "
              f"in at most half (the restatement): {'holds' if ratio <= 1 / 2 else 'no'}.", ""]
    return lines


env = results["environment"]
lines = ["# The shipped agent against greedy and TASO-style search, held out, measured together (issue #49, CPU)", "",
         f"Written by `python docs/results/agent-wide/joint/summary.py` from `results.json` (rlflow {env['rlflow']}, "
         f"commit {env.get('commit') or '?'}, {env['date']}, {env['cpu']}, 1 thread, {results['config']['rounds']} "
         "rounds). Each method at its defaults; speedup: the bench's interleaved measurement of the outputs against "
         "the input, the three methods' outputs of a model in the same rounds, a graph two methods wrote measured "
         "once (`= greedy`); **bold** where the interval lies above 1; time: the whole `optimize` call.", ""]
lines += part("Held-out families and export styles (the twelve)", [m for m in models if m not in SIX])
lines += part("Held-out BERT exports of the trained styles (the six)", [m for m in models if m in SIX])
(here / "summary.md").write_text("\n".join(lines))
print("\n".join(lines))
