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

from rlflow.controller.latent import NEG

LOCATION_TEMPERATURE = 0.1
"""Spread of the location distribution, in the scorer's units (reward / reward scale): matches whose predicted
rewards differ by one percentage point (0.1 at the usual scale of 10) differ by a factor e in probability."""


class WorldModelActor:
    """A world-model agent (`rlflow.worldmodel.agent.Agent`: V, M and the controller) as a candidate policy.

    Use: `reset()` at the start of an episode, `logits(obs)` for the environment's action logits, `observe(action,
    obs)` after each step with the environment action taken and the observation it was taken from.
    """

    def __init__(self, agent, config: Mapping | None = None, reward_range: tuple | None = None):
        from rlflow.worldmodel.agent import Memory, Planning

        self.agent = agent
        self.config = dict(config or {})  # the training run's settings (the dream's, for fine-tuning; its scope)
        self.reward_range = reward_range  # (low, high) the dream's reward clip, from the training episodes
        self.n_rules = agent.n_rules
        for module in (agent.vision, agent.mdrnn, agent.policy, getattr(agent, "location", None)):
            if module is not None:
                module.eval()
        self.memory = Memory(agent, Planning.of(self.config, reward_range))

    def reset(self) -> None:
        """A new episode: h back to M's initial state."""
        self.memory.reset()

    @property
    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """M's (h, c) after the rewrites observed so far."""
        return self.memory.state

    def rule_logits(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(R + 1,) the controller's masked logits over rules and terminate (the last) at this graph."""
        return self.memory.rule_logits(obs)

    def logits(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(C + 1,) logits over the observation's candidates and terminate (the last); see `candidate_logits`."""
        return candidate_logits(self.rule_logits(obs), obs, getattr(self.agent, "location", None))

    def greedy_logits(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(C + 1,) what a greedy rollout takes the argmax of: as `logits`, with the rule M predicts to pay most in
        place of the controller's choice where the agent was trained to plan (`greedy_by="model"`,
        `rlflow.worldmodel.agent.Planning`)."""
        return candidate_logits(self.memory.greedy_rule_scores(obs), obs, getattr(self.agent, "location", None))

    def observe(self, action: int, obs: Mapping[str, np.ndarray]) -> None:
        """Advances h by the rule of candidate `action` of `obs` (the observation it was chosen from)."""
        if action >= len(obs["cand_rule"]):  # terminate
            return
        self.memory.step(int(np.asarray(obs["cand_rule"])[action]), obs)


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
    one, or is from another rule registry; see `rlflow.worldmodel.agent.load_checkpoint`)."""
    from rlflow.worldmodel.agent import load_checkpoint

    agent, payload = load_checkpoint(path, optimisers=False)  # it only acts
    return WorldModelActor(agent, payload.get("config"), payload.get("reward_range")), payload


__all__ = ["WorldModelActor", "candidate_logits", "load_actor", "location_preference", "NEG"]
