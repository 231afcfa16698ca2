"""The world-model agent acting on a real graph: what `rlflow optimize --method agent` plays when its agent is a
world-model checkpoint (`rlflow train --algo worldmodel`).

The controller was trained in the dream over rule types, from the state (z, h): z is V's encoding of the graph, h is
M's memory of the rewrites applied so far.  On a real graph the actor does the same: V encodes the observation, M's
one-step cell advances h after every rewrite, and the controller's logits over rules (masked by the rules that
really have a match) become logits over the environment's candidates.  With a location scorer (see
`rlflow.worldmodel.location`) a candidate's logit is its rule's logit less how far its score (predicted reward, plus
what follows it with `location_gamma`) falls short of the rule's best-scored match, divided by
`LOCATION_TEMPERATURE`: a greedy choice takes the controller's rule at its best-scored match, as the real episodes
that trained the world model did, and sampled rollouts favour the better matches.
Without one (checkpoints from before it) every candidate of a rule gets its rule's logit, so a greedy choice takes
the rule's first listed match.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

NEG = -1e8
"""Logit of an action that cannot be taken."""

LOCATION_TEMPERATURE = 0.1
"""Spread of the location distribution, in the scorer's units (reward / reward scale): matches whose predicted
rewards differ by one percentage point (0.1 at the usual scale of 10) differ by a factor e in probability."""


class WorldModelActor:
    """A world-model agent (`rlflow.worldmodel.train.Agent`: V, M and the controller) as a candidate policy.

    Use: `reset()` at the start of an episode, `logits(obs)` for the environment's action logits, `observe(action,
    obs)` after each step with the environment action taken and the observation it was taken from.
    """

    def __init__(self, agent, config: Mapping | None = None, reward_range: tuple | None = None):
        from rlflow.worldmodel.mdrnn import MDRNNCell

        self.agent = agent
        self.config = dict(config or {})  # the training run's settings (the dream's, for `finetune_in_dream`)
        self.reward_range = reward_range  # (low, high) the dream's reward clip, from the training episodes
        self.n_rules = agent.n_rules
        self.cell = MDRNNCell(agent.mdrnn)
        for module in (agent.vision, agent.mdrnn, agent.policy, getattr(agent, "location", None)):
            if module is not None:
                module.eval()
        self.reset()

    def reset(self) -> None:
        """A new episode: h back to M's initial state."""
        self.state = self.agent.mdrnn.initial_state(1)
        self._encoded = (None, None)  # (observation, its z): `observe` reuses what `logits` just encoded

    @torch.no_grad()
    def _latent(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        from rlflow.controller.policy import obs_to_torch

        if self._encoded[0] is not obs:
            self._encoded = (obs, self.agent.vision.encode(obs_to_torch(obs))[0])
        return self._encoded[1]

    @torch.no_grad()
    def rule_logits(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(R + 1,) the controller's masked logits over rules and terminate (the last) at this graph."""
        from rlflow.controller.dream_ppo import rule_mask_from_obs

        mask = torch.as_tensor(rule_mask_from_obs(obs, self.n_rules)).unsqueeze(0)
        return self.agent.policy.logits(torch.cat([self._latent(obs), self.state[0]], -1), mask)[0]

    def logits(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(C + 1,) logits over the observation's candidates and terminate (the last); see `candidate_logits`."""
        return candidate_logits(self.rule_logits(obs), obs, getattr(self.agent, "location", None))

    @torch.no_grad()
    def observe(self, action: int, obs: Mapping[str, np.ndarray]) -> None:
        """Advances h by the rule of candidate `action` of `obs` (the observation it was chosen from)."""
        if action >= len(obs["cand_rule"]):  # terminate
            return
        rule = int(np.asarray(obs["cand_rule"])[action])
        _, self.state = self.cell(torch.tensor([rule]), self._latent(obs), self.state)


def candidate_logits(per_rule: torch.Tensor, obs: Mapping[str, np.ndarray], scorer=None) -> torch.Tensor:
    """(C + 1,) logits over a real observation's candidates and terminate (the last) from the controller's (R + 1,)
    logits over rules: each listed candidate gets its rule's logit plus its location's preference (with a location
    `scorer`), unlisted slots NEG."""
    n_rules = len(per_rule) - 1
    rules = torch.as_tensor(np.asarray(obs["cand_rule"]), dtype=torch.long).clamp(0, n_rules - 1)
    listed = torch.as_tensor(np.asarray(obs["cand_mask"]).astype(bool))
    out = torch.full((len(rules) + 1,), NEG)
    out[:-1] = torch.where(listed, per_rule[rules] + location_preference(obs, scorer), torch.full((), NEG))
    out[-1] = per_rule[n_rules]
    return out


def location_preference(obs: Mapping[str, np.ndarray], scorer=None) -> torch.Tensor:
    """(C,) per listed candidate, (its predicted reward - the best of its rule's matches) / LOCATION_TEMPERATURE:
    0 at each rule's best-scored match, negative elsewhere (zeros without a location scorer, and for unlisted
    slots)."""
    from rlflow.worldmodel.location import candidate_scores

    out = torch.zeros(len(np.asarray(obs["cand_rule"])))
    listed = np.flatnonzero(np.asarray(obs["cand_mask"]).astype(bool))
    if scorer is None or not len(listed):
        return out
    scores = candidate_scores(scorer, obs, listed) / LOCATION_TEMPERATURE
    rules = torch.as_tensor(np.asarray(obs["cand_rule"])[listed], dtype=torch.long)
    for rule in rules.unique():
        same = rules == rule
        out[torch.as_tensor(listed)[same]] = scores[same] - scores[same].max()
    return out


def load_actor(path) -> tuple[WorldModelActor, dict]:
    """The world-model checkpoint at `path` as an actor, and its payload (refused with one clear line if it is not
    one, or is from another rule registry; see `rlflow.worldmodel.train.load_checkpoint`)."""
    from rlflow.worldmodel.train import load_checkpoint

    agent, payload = load_checkpoint(path)
    return WorldModelActor(agent, payload.get("config"), payload.get("reward_range")), payload


def finetune_in_dream(actor: WorldModelActor, graph, steps: int, *, settings=None, rules=None, cost_model=None,
                      seed: int = 0, deadline: float | None = None):
    """A copy of `actor` whose controller is adapted to `graph` by about `steps` PPO steps in the dream: dreams start
    at V's encoding of this graph and step entirely inside M (no measurement, no real rewrite), with the training
    run's dream settings and reward clip, one PPO update per `dream_envs` x `dream_rollout` steps (the deadline is
    checked between updates).  The given actor is left unchanged.  The cost model only supplies the per-node cost
    feature of the graph's observation, as it did in training.

    Returns:
        (adapted actor, `rlflow.controller.finetune.FinetuneReport`; its steps are dream steps)
    """
    import copy
    import time

    from rlflow.controller.dream_ppo import DreamPPOConfig, train_in_dream
    from rlflow.controller.finetune import FinetuneReport
    from rlflow.env import RewriteEnv
    from rlflow.measure.costmodel import CostModel
    from rlflow.rewrites import RULES
    from rlflow.worldmodel.dream import DreamBatch

    start = time.monotonic()
    torch.manual_seed(seed)
    agent = copy.deepcopy(actor.agent)
    cfg = actor.config
    obs, _ = RewriteEnv(graph, rules=rules or RULES, cost_model=cost_model or CostModel(settings),
                        settings=settings).reset()
    with torch.no_grad():
        from rlflow.controller.policy import obs_to_torch

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


__all__ = ["WorldModelActor", "candidate_logits", "finetune_in_dream", "load_actor", "location_preference", "NEG"]
