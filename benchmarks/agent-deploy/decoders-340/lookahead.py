"""Why the controller loses DistilBERT's skip-LayerNorm round trip: greedy episodes plan one step in M
(`rlflow.agents.worldmodel_agent.Planning`), and a fusion that pays nothing until its inverse follows is never the
one-step best.  This plays each agent's greedy episode on each model twice in the cost-model environment (rule-wide,
10 steps, never revisiting a graph, as training evaluates): planning one step, as shipped, and two steps (a rule's
predicted reward plus the best M predicts after it, where M's availability head says that rule is listed), and
writes the returns (% of the input's estimated time) to lookahead.md.  Nothing here is measured end to end.

    python benchmarks/agent-deploy/decoders-340/lookahead.py AGENT.pt... --models M... --out FILE.md
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from rlflow.agents.actor import load_actor
from rlflow.env.observation import NEG
from rlflow.env.rewrite_env import RewriteEnv
from rlflow.errors import RlflowError
from rlflow.graph.core import load
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES
from rlflow.worldmodel.location import candidate_logits

_SPEC = importlib.util.spec_from_file_location("greedy_episode",
                                               Path(__file__).resolve().parent.parent / "greedy_episode.py")
_GREEDY_EPISODE = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_GREEDY_EPISODE)
play_greedy = _GREEDY_EPISODE.play_greedy  # the loop greedy_episode.py plays, with this script's scores


@torch.no_grad()
def two_step_scores(memory, obs) -> torch.Tensor:
    """(R + 1,) each available rule's one-step predicted reward plus the best one M predicts for the step after it
    (0 where none pays: terminate), from M's most likely next latent; terminate 0."""
    first = memory.predicted_rewards(obs)
    agent, plan = memory.agent, memory.planning
    rules = torch.nonzero(first[:-1] > NEG / 2).squeeze(-1)
    if not len(rules):
        return first
    state = tuple(part.expand(len(rules), -1).contiguous() for part in memory.state)
    out, after = memory.cell(rules, memory.latent(obs).expand(len(rules), -1), state)
    mode = out.logpi.argmax(-1)
    latent = out.mus[torch.arange(len(rules)), mode]  # (A, Z)
    listed = agent.mdrnn.mask_logits(latent, after[0]) > 0  # (A, R): M's availability of the next state
    every = torch.arange(agent.n_rules)
    pairs_a = torch.repeat_interleave(torch.arange(len(rules)), agent.n_rules)
    nxt, _ = memory.cell(every.repeat(len(rules)), latent[pairs_a], tuple(p[pairs_a] for p in after))
    paid = ((nxt.reward - plan.reward_penalty * nxt.reward_std) * plan.reward_scale).view(len(rules), -1)
    if plan.reward_range is not None:
        low, high = (torch.as_tensor(b, dtype=torch.float32).expand(agent.n_rules) for b in plan.reward_range)
        paid = torch.minimum(torch.maximum(paid, low), high)
    best = torch.where(listed, paid, torch.full_like(paid, NEG)).max(-1).values.clamp(min=0.0)
    scores = first.clone()
    scores[rules] = first[rules] + best
    return scores


def episode(actor, path: Path, cost_model, settings, depth: int) -> tuple[float, list[str]]:
    """(return, rules) of the agent's greedy episode on `path` (`greedy_episode.play_greedy`), planning `depth` (1 or
    2) steps in M."""
    env = RewriteEnv(load(path), rules=RULES[:actor.agent.n_rules], cost_model=cost_model, settings=settings,
                     scope="rule", max_episode_steps=int(actor.config.get("max_episode_steps", 10)))
    location = getattr(actor.agent, "location", None)
    logits = None if depth == 1 else (lambda obs: candidate_logits(two_step_scores(actor.memory, obs), obs, location))
    steps = play_greedy(actor, env, logits=logits)
    return sum(reward for _, _, reward in steps), [rule for rule, _, _ in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("agents", nargs="+", type=Path)
    parser.add_argument("--models", nargs="+", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = SessionSettings(threads=1)
    cost_model = CostModel(settings)
    lines = ["# Greedy episodes planning one step in M, and two", "",
             f"`python benchmarks/agent-deploy/decoders-340/lookahead.py {' '.join(map(str, args.agents))} "
             f"--models {' '.join(map(str, args.models))} --out {args.out}`", "",
             "Returns: % of the input's estimated time saved (the cost model's, as training rewards it).", ""]
    for agent in args.agents:
        try:
            actor, _ = load_actor(agent)
        except RlflowError as exc:  # a missing or foreign checkpoint: one line, nothing written
            raise SystemExit(f"error: {exc}") from None
        lines += [f"## `{agent}`", "", "| model | one step | two steps | two steps' rules |", "| --- | ---: | ---: | --- |"]
        sums = [0.0, 0.0]
        for model in args.models:
            one, _ = episode(actor, model, cost_model, settings, 1)
            two, rules = episode(actor, model, cost_model, settings, 2)
            sums[0] += one
            sums[1] += two
            lines.append(f"| {model.stem} | {one:+.2f} | {two:+.2f} | {', '.join(rules)} |")
            print(lines[-1], flush=True)
        n = len(args.models)
        lines += [f"| **mean** | **{sums[0] / n:+.2f}** | **{sums[1] / n:+.2f}** | |", ""]
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
