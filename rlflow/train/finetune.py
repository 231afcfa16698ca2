"""Per-model adaptation of the shipped agent before it optimises a model (`rlflow optimize --finetune N`).

This is the one place where `rlflow optimize` reaches a trainer, and only with `--finetune`: a PPO policy adapts with
the masked-PPO learner (`rlflow.train.ppo`), a world-model agent with dream PPO (`rlflow.train.worldmodel.dream_ppo`).

An agent was trained on other models; a few hundred steps on the user's own graph let it learn which of that graph's
rewrites the cost model rewards.  They run against the cost model only (no end-to-end measurement), so they are cheap
and leave the input untouched; the search that follows measures as usual.  A PPO policy adapts in the cost-model
environment, the reward it was trained on; the shipped world-model agent adapts its controller in its own dream.
Whether adaptation pays is not established (docs/agents.md), hence opt-in.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np

from rlflow.graph.core import Graph, load


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
    from rlflow.env.features import observation_caps
    from rlflow.env.rewrite_env import RewriteEnv
    from rlflow.measure.costmodel.model import CostModel

    graph = graph if isinstance(graph, Graph) else load(graph)
    from rlflow.rewrites import RULES
    from rlflow.train.ppo import Config, Learner

    start = time.monotonic()
    adapted = copy.deepcopy(policy).train()
    config = Config(num_steps=ROLLOUT_STEPS, num_minibatches=4, anneal_lr=False,  # otherwise training's settings
                    max_episode_steps=25, seed=seed)
    cost_model = cost_model if cost_model is not None else CostModel(settings)  # an empty one is falsy
    updates, stop = 0, "steps done"
    with cost_model.measuring_until(deadline):  # past it, groups the table lacks are estimated, not measured
        trained = getattr(policy, "config", None) or {}  # the scope it was trained in (`load_checkpoint`)
        env = RewriteEnv(graph, rules=rules or RULES, cost_model=cost_model, settings=settings,
                         scope=trained.get("scope", "match"), max_episode_steps=config.max_episode_steps,
                         **observation_caps(graph))
        learner = Learner(adapted, env, config, np.random.default_rng(seed))
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


def finetune_in_dream(actor, graph, steps: int, *, settings=None, rules=None, cost_model=None,
                      seed: int = 0, deadline: float | None = None):
    """A copy of `actor` (a `rlflow.agents.actor.WorldModelActor`) whose controller is adapted to `graph` by about `steps` PPO steps in the dream: dreams start
    at V's encoding of this graph and step entirely inside M (no measurement, no real rewrite), with the training
    run's dream settings and reward clip, one PPO update per `dream_envs` x `dream_rollout` steps (the deadline is
    checked between updates).  The given actor is left unchanged.  The cost model only supplies the per-node cost
    feature of the graph's observation, as it did in training.

    Returns:
        (adapted actor, `FinetuneReport`; its steps are dream steps)
    """
    import torch

    from rlflow.agents.actor import WorldModelActor
    from rlflow.env.features import observation_caps
    from rlflow.env.rewrite_env import RewriteEnv
    from rlflow.measure.costmodel.model import CostModel

    graph = graph if isinstance(graph, Graph) else load(graph)
    from rlflow.rewrites import RULES
    from rlflow.train.worldmodel.dream import DreamBatch
    from rlflow.train.worldmodel.dream_ppo import DreamPPOConfig, train_in_dream

    start = time.monotonic()
    torch.manual_seed(seed)
    agent = copy.deepcopy(actor.agent)
    cfg = actor.config
    cost_model = cost_model if cost_model is not None else CostModel(settings)  # an empty one is falsy
    with cost_model.measuring_until(deadline):  # past it, groups the table lacks are estimated, not measured
        obs, _ = RewriteEnv(graph, rules=rules or RULES, cost_model=cost_model, settings=settings,
                            **observation_caps(graph)).reset()
    with torch.no_grad():
        from rlflow.env.observation import obs_to_torch

        mu, logvar = agent.vision.encode(obs_to_torch(obs))
    if not cfg.get("sample_latents", False):  # as training's dreams start: at the posterior mean
        logvar = torch.full_like(logvar, -float("inf"))
    envs, rollout = int(cfg.get("dream_envs", 64)), int(cfg.get("dream_rollout", 32))
    low_high = None
    if actor.reward_range is not None:
        low_high = tuple(torch.as_tensor(bound, dtype=torch.float32) for bound in actor.reward_range)
    dream = DreamBatch(agent.mdrnn, mu, logvar, envs, temperature=float(cfg.get("temperature", 1.0)),
                       max_episode_steps=int(cfg.get("max_episode_steps", 25)),
                       reward_scale=float(cfg.get("reward_scale", 10.0)),
                       reward_penalty=float(cfg.get("reward_penalty", 1.0)), reward_range=low_high, seed=seed)
    ppo = DreamPPOConfig(total_steps=envs * rollout, num_envs=envs, num_steps=rollout,
                         learning_rate=float(cfg.get("controller_lr", 1e-3)),
                         gamma=float(cfg.get("controller_gamma", 0.99)), ent_coef=float(cfg.get("ent_coef", 0.01)))
    agent.policy.train()
    optimizer = torch.optim.Adam(agent.policy.parameters(), lr=ppo.learning_rate, eps=1e-5)
    returns, updates, stop = [], 0, "steps done"
    while updates * envs * rollout < steps:
        if deadline is not None and time.monotonic() > deadline:
            stop = "time limit"
            break
        returns.append(float(train_in_dream(agent.policy, optimizer, dream, ppo)["dream_return"]))
        updates += 1
    finite = [r for r in returns if np.isfinite(r)]
    report = FinetuneReport(updates * envs * rollout, updates, time.monotonic() - start,
                            finite[0] if finite else None, finite[-1] if finite else None, stop, "dream")
    return WorldModelActor(agent, cfg, actor.reward_range), report
