"""Summary of run.sh's runs (issue #47's targets) as summary.md: rows and statuses against the run without Ray, the
cost tables' travel, the node removed mid-run, and the trainer's real-episode wall time with and without --ray.

Some of its inputs left the tree with issue #80 (git keeps them): `git checkout c3883d3 --
docs/results/cluster/first docs/results/cluster/second docs/results/cluster/local` brings them back.
"""
import json
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {name: json.loads((out / name / "results.json").read_text()) for name in ("first", "second", "local")}
kinds = {name: sorted((r["model"], r["method"], r["status"]) for r in run["rows"]) for name, run in runs.items()}
removed = re.search(r"removed node (\w+) after (\d+) s", (out / "cluster.log").read_text())
lines = ["# Issue #47's targets on a simulated 3-node cluster", "",
         "Written by `bash benchmarks/cluster/run.sh` (`benchmarks/cluster/summarize.py`); the nodes share one 2-core "
         "machine, so wall times are reported, not claimed as speedups.", "",
         "| bench run | rows | ok | same rows and statuses as without Ray | groups added | measured before the run "
         "(shipping missed) | measured twice in the run | wall |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
walls = dict(line.split(": ") for line in (out / "walls.txt").read_text().splitlines())
for name, run in runs.items():
    tables = run.get("cost_tables", {})
    lines.append(f"| {name} | {len(run['rows'])} | {sum(r['status'] == 'ok' for r in run['rows'])} | "
                 f"{'yes' if kinds[name] == kinds['local'] else 'NO'} | {tables.get('added', '-')} | "
                 f"{tables.get('known_before', '-')} | {tables.get('measured_twice', '-')} | {walls.get(name, '-')} |")
lines += ["", f"Node removed mid-run: {removed.group(1)} after {removed.group(2)} s of the cluster's life"
          if removed else "No node was removed."]
log = out / "run.log"
retries = [re.sub(r"\x1b\[[0-9;]*m", "", line).split(" Error:")[0] for line in log.read_text().splitlines()
           if "will be retried" in line] if log.exists() else []
lines += [f"Ray's log (run.log): `{line.strip()}`" for line in retries] + [""]
deleted = out / "deleted.txt"
if deleted.exists():
    lines += [f"- {line}" for line in deleted.read_text().splitlines()] + [""]
else:  # the 2026-11-28 run: run.sh's deletion line went into the bench's log, which the bench then overwrote
    lines += ["The model files were deleted once each run's results file appeared (run.sh; its line recording when "
              "was lost to the bench's log in this run and now goes to deleted.txt).", ""]
for name in ("first", "second"):
    nodes = {}
    for r in runs[name]["rows"]:
        nodes.setdefault(r["node"], set()).add(r["model"])
    lines.append(f"- {name}: models per node " + ", ".join(f"`{n}` {len(m)}" for n, m in sorted(nodes.items())))
    per_node = runs[name].get("cost_tables", {}).get("per_node", {})
    lines.append("  cost tables per node: " + "; ".join(
        f"`{n}` {c['tasks']} tasks, installed {c['installed']}, added {c['added']}" for n, c in sorted(per_node.items())))
train = {name: json.loads((out / f"train-{name}" / "worldmodel.json").read_text()) for name in ("ray", "local")}
lines += ["", "| trainer run | real steps | real-episode wall (s) | whole run (s) | reward Pearson | episodes per node |",
          "| --- | ---: | ---: | ---: | ---: | --- |"]
for name, result in train.items():
    nodes = result.get("cluster", {}).get("nodes", {})
    per_node = ", ".join(f"`{n}` {c['tasks']}" for n, c in sorted(nodes.items())) or "here"
    lines.append(f"| {name} | {result['real_steps_worldmodel']} | {result['real_episode_seconds']:.0f} | "
                 f"{result['wall_seconds']:.0f} | {result['reward_pearson']:.3f} | {per_node} |")
lines += ["Reward Pearson of runs this short (two iterations, one seed each) swings from run to run: it says "
          "only that both runs produce the same report, not how well either learns."]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
