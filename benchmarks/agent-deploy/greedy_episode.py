"""A world-model agent's greedy episode on a model, step by step: the rule it takes, the reward M predicts for it and
the cost model's reward (the environment's).  The agent search plays this episode first (`rlflow.search.agent`);
where it stops early, the sampled episodes, which never stop, supply the graphs measured.  Beside first_step.py
(every rule at the first step), this shows the later steps.

    python benchmarks/agent-deploy/greedy_episode.py AGENT.pt... --model MODEL.onnx --out FILE.md
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from rlflow.agents.actor import load_actor
from rlflow.agents.unvisited import choose_unvisited
from rlflow.env.rewrite_env import RewriteEnv
from rlflow.errors import RlflowError
from rlflow.graph.core import load
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES


def greedy_episode(agent: Path, model: Path, cost_model, settings) -> list[tuple[str, float | None, float]]:
    """`play_greedy` of the agent at `agent` on `model`, in the scope and at most the length of its training
    episodes."""
    actor, _ = load_actor(agent)
    env = RewriteEnv(load(model), cost_model=cost_model, settings=settings, scope=actor.config.get("scope", "match"),
                     max_episode_steps=int(actor.config.get("max_episode_steps", 25)))
    return play_greedy(actor, env)


@torch.no_grad()
def play_greedy(actor, env, index: int = 0, logits=None) -> list[tuple[str, float | None, float]]:
    """[(rule or "stop", M's predicted reward or None, the environment's reward)] of `actor`'s greedy episode on model
    `index` of `env`, played as the agent search plays it (never revisiting a graph; plan_vs_controller.py sums its
    rewards); `logits` (obs -> candidate logits) in place of `actor.greedy_logits` (decoders-340/lookahead.py)."""
    logits = logits or actor.greedy_logits
    scale = float(actor.config.get("reward_scale", 10.0))
    obs, _ = env.reset(options={"model": index})
    actor.reset()
    seen, steps, done = {env.fingerprint}, [], False
    while not done:
        action = choose_unvisited(env, logits(obs), seen, greedy=True, may_terminate=True,
                                  temperature=1.0, generator=torch.Generator().manual_seed(0))
        rules = np.asarray(obs["cand_rule"])
        rule = int(rules[action]) if action < len(rules) else len(RULES)
        predicted = None
        if rule < len(RULES):
            out, _ = actor.memory.cell(torch.tensor([rule]), actor.memory.latent(obs), actor.memory.state)
            predicted = float(out.reward[0]) * scale
        actor.observe(action, obs)
        obs, reward, terminated, truncated, _ = env.step(action)
        seen.add(env.fingerprint)
        steps.append((RULES[rule].name if rule < len(RULES) else "stop", predicted, float(reward)))
        done = terminated or truncated
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("agents", nargs="+", type=Path)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = SessionSettings(threads=1)
    cost_model = CostModel(settings)
    lines = ["# Greedy episodes, step by step", "",
             f"`python benchmarks/agent-deploy/greedy_episode.py {' '.join(map(str, args.agents))} --model "
             f"{args.model} --out {args.out}`", "",
             "Rewards in % of the estimated runtime: M's prediction, and the cost model's (the environment's).", ""]
    for agent in args.agents:
        try:
            steps = greedy_episode(agent, args.model, cost_model, settings)
        except RlflowError as exc:  # a missing or foreign checkpoint or model: one line, nothing written
            raise SystemExit(f"error: {exc}") from None
        lines += [f"## `{agent}`", "", "| step | rule | M predicts | cost model |", "|---:|---|---:|---:|"]
        lines += [f"| {i} | {rule} | {'' if p is None else f'{p:+.2f}'} | {r:+.2f} |"
                  for i, (rule, p, r) in enumerate(steps, 1)]
        lines.append("")
        print("\n".join(lines[-len(steps) - 5:]), flush=True)
    cost_model.save()
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
