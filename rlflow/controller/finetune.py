"""Per-model adaptation of the shipped agent before it optimises a model (`rlflow optimize --finetune N`).

The shipped policy was trained on other models; a few hundred PPO steps on the user's own graph let it learn which of
that graph's rewrites the cost model rewards.  The steps run against the cost model only (no end-to-end measurement),
so they are cheap and leave the input untouched; the search that follows measures as usual.

The shipped agent is the candidate-scoring PPO policy, so it adapts in the cost-model environment (the same reward it
was trained on), not in the world model's dream: the dream controller acts over rule types, not over locations.

Measured so far (shared 2-core machine, 1 thread): 128 steps on inception-v3 took 47 s, 256 on nasrnn 50 s, and in
both the adapted policy's greedy cost-model return was the same as before.  A few updates are far fewer than the
~60 PPO updates of training; whether longer adaptation pays off is not yet established, hence opt-in.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np

from rlflow.graph import Graph


@dataclass
class FinetuneReport:
    """What adaptation did: real (cost-model) steps taken, PPO updates, seconds, and why it stopped."""

    steps: int
    updates: int
    seconds: float
    mean_return_first: float | None
    mean_return_last: float | None
    stop_reason: str
    environment: str = "cost model"  # where the steps were taken: "cost model" (PPO policy) or "dream" (world model)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


ROLLOUT_STEPS = 64
"""Steps per PPO update: small, so that a time limit is checked often and a short budget still updates."""


def finetune(policy, graph: Graph, steps: int, *, settings=None, rules=None, cost_model=None, seed: int = 0,
             deadline: float | None = None):
    """A copy of `policy` adapted to `graph` by about `steps` masked-PPO steps; the given policy is left unchanged.

    Args:
        steps: cost-model environment steps (rounded up to whole rollouts of ROLLOUT_STEPS).
        deadline: a time.monotonic() value after which no new rollout starts.

    Returns:
        (adapted policy in evaluation mode, FinetuneReport)
    """
    from rlflow.controller.ppo import Config, Learner
    from rlflow.env import RewriteEnv
    from rlflow.measure.costmodel import CostModel
    from rlflow.rewrites import RULES

    start = time.monotonic()
    adapted = copy.deepcopy(policy).train()
    config = Config(num_steps=ROLLOUT_STEPS, num_minibatches=4, anneal_lr=False,  # otherwise training's settings
                    max_episode_steps=25, seed=seed)
    cost_model = cost_model or CostModel(settings)
    env = RewriteEnv(graph, rules=rules or RULES, cost_model=cost_model, settings=settings,
                     max_episode_steps=config.max_episode_steps)
    learner = Learner(adapted, env, config, np.random.default_rng(seed))
    updates, stop = 0, "steps done"
    while updates * ROLLOUT_STEPS < steps:
        if deadline is not None and time.monotonic() > deadline:
            stop = "time limit"
            break
        learner.collect()
        learner.update()
        updates += 1
    cost_model.save()
    returns = [e["return"] for e in learner.episodes]
    quarter = max(1, len(returns) // 4)
    report = FinetuneReport(env.real_steps, updates, time.monotonic() - start,
                            float(np.mean(returns[:quarter])) if returns else None,
                            float(np.mean(returns[-quarter:])) if returns else None, stop)
    return adapted.eval(), report
