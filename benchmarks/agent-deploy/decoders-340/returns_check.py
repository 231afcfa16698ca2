"""What a training return on DistilBERT is made of: two rule sequences' cost-model returns (the environment's
rewards, `--scope rule`) beside their end-to-end speedups (interleaved, 1 thread), and the table's cost of the GELU
group each leaves against fresh measurements of that group.

    python benchmarks/agent-deploy/decoders-340/returns_check.py     # writes returns-check.md beside it
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rlflow.env.rewrite_env import RewriteEnv
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites import RULES

HERE = Path(__file__).resolve().parents[3] / "docs" / "results" / "agent-deploy" / "decoders-340"
MODEL = "models/distilbert-base-s16-dynamo.onnx"
SEQUENCES = ([], ["skip-layernorm-fusion", "skip-layernorm-unfuse"], ["mul-add-distribute"], ["skip-layernorm-fusion"],
             ["gelu-fusion"])
IDS = {r.name: i for i, r in enumerate(RULES)}


def play(cost_model, settings, sequence, model: str = MODEL):
    """The graph and the summed rewards of `sequence` on `model`, each rule applied rule-wide at its first listed
    match."""
    env = RewriteEnv(model, cost_model=cost_model, settings=settings, scope="rule", max_episode_steps=50)
    obs, _ = env.reset(options={"model": 0})
    total = 0.0
    for name in sequence:
        listed = np.flatnonzero((np.asarray(obs["cand_rule"]) == IDS[name]) & (np.asarray(obs["cand_mask"]) == 1))
        obs, reward, *_ = env.step(int(listed[0]))
        total += reward
    return env.graph, total


def gelu_groups(cost_model, graph):
    """(operators, the table's cost, three fresh measurements) of each distinct group holding an Erf or a Gelu."""
    seen, out = set(), []
    for group in cost_model.groups(graph):
        ops = "+".join(n.op for n in group.members)
        if group.key in seen or not ({"Erf", "Gelu"} & {n.op for n in group.members}):
            continue
        seen.add(group.key)
        out.append((ops, cost_model._group_cost(graph, group), cost_model.remeasure(graph, group, 3)))
    return out


def main() -> None:
    settings = SessionSettings(threads=1)
    cost_model = CostModel(settings)
    played = [play(cost_model, settings, s) for s in SEQUENCES]
    timing = compare([g.to_model() for g, _ in played], settings, rounds=20, seed=0)
    lines = ["# Training returns against measurement, DistilBERT-base dynamo (s16)", "",
             "Written by `python benchmarks/agent-deploy/decoders-340/returns_check.py`: each sequence's cost-model "
             "return (% of the input's estimated time saved, the training reward) and its end-to-end speedup over "
             "the input (20 interleaved rounds, 1 thread, median [95% interval]).", "",
             "| rules, each rule-wide | cost-model return | measured speedup |", "| --- | ---: | --- |"]
    for sequence, (_, ret), ratio in zip(SEQUENCES, played, timing.ratios):
        lines.append(f"| {', '.join(sequence) or '(input)'} | {ret:+.2f} | {ratio.median:.3f} "
                     f"[{ratio.low:.3f}, {ratio.high:.3f}] |")
    lines += ["", "The GELU groups (a layer's feed-forward MatMul, bias and GELU, as the cost model cuts it): the "
              "table's cost of one, and three fresh measurements of it now, ms.", "",
              "| after | group | table | measured now |", "| --- | --- | ---: | --- |"]
    for sequence, (graph, _) in zip(SEQUENCES, played):
        for ops, cost, fresh in gelu_groups(cost_model, graph):
            lines.append(f"| {', '.join(sequence) or '(input)'} | {ops} | {cost:.3f} | "
                         f"{', '.join(f'{x:.3f}' for x in fresh)} |")
    (HERE / "returns-check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
