"""What a world-model agent makes of a model's first rule-wide step: per rule with a match, the reward M predicts,
the cost model's reward (the environment's), whether M predicts the rule available, and the controller's
probability of taking it.  Shows whether a missed rewrite is the world model's error or the controller's choice.

    python benchmarks/agent-deploy/first_step.py AGENT.pt MODEL.onnx... --out FILE.md
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from rlflow.agents.actor import load_actor
from rlflow.env.observation import first_candidate, rule_mask_from_obs
from rlflow.env.rewrite_env import RewriteEnv
from rlflow.graph.core import load
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES

SHOWN = 6
"""Rules per model in the table: the cost model's best first steps."""


@torch.no_grad()
def first_steps(actor, path: Path, cost_model) -> tuple[list[tuple], float]:
    """[(rule, M's predicted reward, cost model's reward, M's availability, controller probability)] for every rule
    with a match at the input graph, best real reward first; and the controller's probability of terminating."""
    env = RewriteEnv(load(path), rules=RULES, cost_model=cost_model, scope="rule", max_episode_steps=10)
    obs, _ = env.reset(options={"model": 0})
    actor.reset()
    memory, scale = actor.memory, float(actor.config.get("reward_scale", 10.0))
    probs = torch.softmax(memory.rule_logits(obs), -1)
    latent, state = memory.latent(obs), memory.state
    available = torch.sigmoid(actor.agent.mdrnn.mask_logits(latent, state[0]))[0]
    rows = []
    for rule in np.flatnonzero(rule_mask_from_obs(obs, len(RULES))[:-1]):
        predicted = float(memory.cell(torch.tensor([int(rule)]), latent, state, None)[0].reward[0]) * scale
        env.reset(options={"model": 0})
        _, reward, *_ = env.step(first_candidate(obs, int(rule)))
        rows.append((RULES[rule].name, predicted, reward, float(available[rule]), float(probs[rule])))
    return sorted(rows, key=lambda row: -row[2]), float(probs[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("agent")
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    actor, _ = load_actor(args.agent)
    cost_model = CostModel(SessionSettings())
    lines = [f"# First rule-wide step: `{args.agent}`", "",
             f"`python benchmarks/agent-deploy/first_step.py {args.agent} {' '.join(args.models)} --out {args.out}`",
             "", "Per model, the rules with a match at the input whose rule-wide step the cost model rates best: "
             "reward in % of the input's estimated time (M's prediction, the environment's cost-model reward), M's "
             "predicted availability, and the controller's probability of taking the rule first.", "",
             "| model | rule | M predicts | cost model | M: available | controller p |", "|---|---|---:|---:|---:|---:|"]
    for model in args.models:
        rows, stop = first_steps(actor, Path(model), cost_model)
        lines += [f"| {Path(model).stem} | {name} | {predicted:+.2f} | {real:+.2f} | {available:.2f} | {p:.3f} |"
                  for name, predicted, real, available, p in rows[:SHOWN]]
        top = max(rows, key=lambda row: row[4])
        if top not in rows[:SHOWN]:
            lines.append(f"| {Path(model).stem} | {top[0]} (the controller's choice) | {top[1]:+.2f} | "
                         f"{top[2]:+.2f} | {top[3]:.2f} | {top[4]:.3f} |")
        lines.append(f"| {Path(model).stem} | (terminate) | | | | {stop:.3f} |")
    cost_model.save()
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
