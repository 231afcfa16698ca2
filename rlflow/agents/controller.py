"""The world-model agent's controller network.

`LatentPolicy` is the C of World Models: an actor-critic over the world model's state (z, h) that picks a rule type
or terminate.  The dream masks it with the rules the world model predicts to be available; a real graph with the
rules that really have a listed match (`rlflow.env.observation.rule_mask_from_obs`).  Training it is
`rlflow.train.worldmodel.dream_ppo`'s.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributions import Categorical

from rlflow.env.observation import NEG


class LatentPolicy(nn.Module):
    """Actor-critic MLP over the world model's state (z, h).

    Args:
        obs_size: Z + H.
        n_actions: rules plus terminate.
        hidden: width of the hidden layers.
    """

    def __init__(self, obs_size: int, n_actions: int, hidden: int = 128):
        super().__init__()
        self.obs_size, self.n_actions, self.hidden = obs_size, n_actions, hidden
        self.actor = nn.Sequential(nn.Linear(obs_size, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                   nn.Linear(hidden, n_actions))
        self.critic = nn.Sequential(nn.Linear(obs_size, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                    nn.Linear(hidden, 1))
        with torch.no_grad():  # CleanRL's small actor-output init: start near uniform
            self.actor[-1].weight.mul_(0.01)

    def spec(self) -> dict:
        return {"obs_size": self.obs_size, "n_actions": self.n_actions, "hidden": self.hidden}

    def logits(self, obs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked logits (B, A): obs (B, Z + H), mask (B, A) bool."""
        return torch.where(mask, self.actor(obs), torch.full((), NEG))

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def get_action_and_value(self, obs: torch.Tensor, mask: torch.Tensor, action: torch.Tensor | None = None,
                             greedy: bool = False):
        """(action, log-probability, entropy over valid actions, value), each (B,)."""
        logits = self.logits(obs, mask)
        dist = Categorical(logits=logits)
        if action is None:
            action = logits.argmax(-1) if greedy else dist.sample()
        logp = torch.log_softmax(logits, -1)
        entropy = -(torch.where(mask, logp.exp() * logp, torch.zeros_like(logp))).sum(-1)
        return action, dist.log_prob(action), entropy, self.get_value(obs)
