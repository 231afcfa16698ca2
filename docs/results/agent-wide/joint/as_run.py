"""Where the agent's output measured more than 1% behind greedy's on the held-out exports (issue #49's never-behind
target), does greedy's output run anything else?  For each such model and bench seed of `seed*/results.json` where the
agent's winner was the fuse-everything graph and greedy's rewrites are the agent's plus some more, the two graphs are
rebuilt from the model (every fusion, then the inverse the agent's row names; then greedy's further rules wherever
greedy's row names them), their rule counts checked against the rows', and both fingerprinted as onnxruntime runs them
(`rlflow.measure.as_run`, CPU provider, ORT_ENABLE_ALL).  Written to as-run.md.

    python docs/results/agent-wide/joint/as_run.py      # models in models/ (rlflow zoo build ... --out models)
"""
import json
from collections import Counter
from pathlib import Path

from rlflow.graph.core import load
from rlflow.measure.as_run import fingerprint_as_run
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import GROUPS, RULES, apply_everywhere
from rlflow.rewrites.base import apply_all
from rlflow.search.candidates import Candidate, all_fusions

here = Path(__file__).resolve().parent
INVERSES = {r.name for r in GROUPS["inverse"]}


def rules_of(row) -> Counter:
    return Counter(r.split("@")[0] for r in row["rewrites"])


def with_rules(graph, names, only=None):
    """`graph` with each rule of `names` applied wherever it matches (at the rewrites `only` lists, where given)."""
    applied = Counter()
    for name in names:
        rule = next(r for r in RULES if r.name == name)
        if only is None:
            graph, done = apply_everywhere(graph, rule, rule.find(graph), RULES)
        else:
            graph, done = apply_all(graph, [m for m in rule.find(graph) if str(m) in only], RULES)
        applied[name] += len(done)
    return graph, applied


lines = ["# Greedy's lead over the agent, as onnxruntime runs the two graphs", "",
         "Written by `python docs/results/agent-wide/joint/as_run.py`. Cases: the agent behind greedy by more than 1% "
         "where greedy gains, its winner the fuse-everything graph, greedy's rewrites the agent's and more. `agent` "
         "and `greedy` are rebuilt from the model (every fusion, the inverse the agent's row names wherever it matches; "
         "then greedy's further rewrites where its row names them); `rules match`: their rule counts are the rows'.",
         "",
         "| model | bench seed | agent | greedy | greedy's further rewrites | rules match (agent, greedy) | "
         "nodes (agent, greedy) | same graph | same as onnxruntime runs it |",
         "| --- | --- | ---: | ---: | --- | --- | --- | --- | --- |"]
settings = SessionSettings()
for seed in sorted(here.glob("seed[0-9]")):
    rows = json.loads((seed / "results.json").read_text())["rows"]
    for agent in (r for r in rows if r["method"] == "agent" and r["status"] == "ok"):
        greedy = next(r for r in rows if r["model"] == agent["model"] and r["method"] == "greedy")
        behind = greedy["speedup_low"] > 1 and agent["speedup"] < greedy["speedup"] / 1.01
        more = rules_of(greedy) - rules_of(agent)
        if not (behind and "fuse-everything" in agent["search_stop"] and not rules_of(agent) - rules_of(greedy)):
            continue
        graph = load(f"models/{agent['model']}.onnx")
        fused = all_fusions(Candidate(graph, (), graph.fingerprint()), RULES)
        built = Counter(m.rule for m in fused.applied)
        a, undone = with_rules(fused.graph, [n for n in rules_of(agent) if n in INVERSES])
        b, further = with_rules(a, list(more), only=set(greedy["rewrites"]))
        match = (built + undone == rules_of(agent), built + undone + further == rules_of(greedy))
        as_run = fingerprint_as_run(a, settings) == fingerprint_as_run(b, settings)
        lines.append(f"| {agent['model']} | {seed.name} | {agent['speedup']:.3f} | {greedy['speedup']:.3f} | "
                     f"{', '.join(f'{n} x{c}' for n, c in more.items())} | {'yes' if match[0] else 'no'}, "
                     f"{'yes' if match[1] else 'no'} | {len(a.gs.nodes)}, {len(b.gs.nodes)} | "
                     f"{'yes' if a.fingerprint() == b.fingerprint() else 'no'} | **{'yes' if as_run else 'no'}** |")
(here / "as-run.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
