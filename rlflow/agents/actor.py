"""The world-model agent acting on a real graph: what `rlflow optimize --method agent` plays when its agent is a
world-model checkpoint (`rlflow train --algo worldmodel`).

The controller was trained in the dream over rule types, from the state (z, h): z is V's encoding of the graph, h is
M's memory of the rewrites applied so far.  On a real graph the actor does the same: V encodes the observation, M's
one-step cell advances h after every rewrite, and the controller's logits over rules (masked by the rules that
really have a match) become logits over the environment's candidates.  With a location scorer (see
`rlflow.worldmodel.location`) a candidate's logit is its rule's logit less how far its score (predicted reward, plus
what follows it with `location_gamma`) falls short of the rule's best-scored match, divided by
`rlflow.worldmodel.location.LOCATION_TEMPERATURE`: a greedy choice takes the controller's rule at its best-scored
match, as the real episodes that trained the world model did, and sampled rollouts favour the better matches.
Without one (checkpoints from before it) every candidate of a rule gets its rule's logit, so a greedy choice takes
the rule's first listed match.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from rlflow.worldmodel.location import candidate_logits


class WorldModelActor:
    """A world-model agent (`rlflow.agents.worldmodel_agent.Agent`: V, M and the controller) as a candidate policy.

    Use: `reset()` at the start of an episode, `logits(obs)` for the environment's action logits, `observe(action,
    obs)` after each step with the environment action taken and the observation it was taken from.
    """

    def __init__(self, agent, config: Mapping | None = None, reward_range: tuple | None = None):
        from rlflow.agents.worldmodel_agent import Memory, Planning

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
        `rlflow.agents.worldmodel_agent.Planning`)."""
        return candidate_logits(self.memory.greedy_rule_scores(obs), obs, getattr(self.agent, "location", None))

    def observe(self, action: int, obs: Mapping[str, np.ndarray]) -> None:
        """Advances h by the rule of candidate `action` of `obs` (the observation it was chosen from)."""
        if action >= len(obs["cand_rule"]):  # terminate
            return
        self.memory.step(int(np.asarray(obs["cand_rule"])[action]), obs)


def load_actor(path) -> tuple[WorldModelActor, dict]:
    """The world-model checkpoint at `path` as an actor, and its payload (refused with one clear line if it is not
    one, or is from a rule registry this one does not extend; see `rlflow.agents.worldmodel_agent.load_checkpoint`)."""
    from rlflow.agents.worldmodel_agent import load_checkpoint

    agent, payload = load_checkpoint(path, optimisers=False, prefix=True)  # it only acts, on the rules it knows
    return WorldModelActor(agent, payload.get("config"), payload.get("reward_range")), payload


__all__ = ["WorldModelActor", "load_actor"]
