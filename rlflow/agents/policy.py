"""The candidate-scoring policy: picks one (rule, location) match, or terminate, from the graph encoder's embeddings.

Each candidate is scored from the embedding of its rule, of its root node, of the mean of the nodes it touches and of
the whole graph; terminate is scored from the graph alone.  Nothing depends on the number of nodes or candidates, so
one policy runs on graphs of any size and on models it has never seen.  Invalid actions (padding) get a logit of
-1e8: they are never sampled and carry no gradient.

Checkpoints (`save_checkpoint`, `load_checkpoint`) hold the weights, the optimiser state, the trainer config and the
rule-registry and observation versions; loading under another rule registry is refused, since rule ids would mean
other rules.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from torch import nn
from torch.distributions import Categorical

from rlflow.agents.checkpoint import load_checkpoint_payload, save_checkpoint_atomic
from rlflow.env.features import MAX_TOUCHED, OBS_VERSION
from rlflow.env.observation import NEG
from rlflow.worldmodel.encoder import GraphEncoder, trim

CHECKPOINT_FORMAT = 1


def action_mask_from_obs(obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(B, C + 1) bool: the listed candidates, and terminate (always valid)."""
    cand = obs["cand_mask"].bool()
    return torch.cat([cand, torch.ones_like(cand[:, :1])], -1)


class CandidatePolicy(nn.Module):
    """Actor-critic over the environment's candidate list.

    Args:
        n_rules: size of the rule registry the policy is trained on (rule ids index an embedding).
        hidden: width of every embedding and hidden layer.
        rounds: message-passing rounds of the encoder.
    """

    def __init__(self, n_rules: int, hidden: int = 64, rounds: int = 3):
        super().__init__()
        self.n_rules, self.hidden, self.n_rounds = n_rules, hidden, rounds
        self.encoder = GraphEncoder(hidden, rounds)
        self.rule_embed = nn.Embedding(max(n_rules, 1), hidden)
        self.score = nn.Sequential(nn.Linear(4 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.stop = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.critic = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        with torch.no_grad():  # start near uniform over candidates, as CleanRL's small actor-output init does
            self.score[-1].weight.mul_(0.01)
            self.stop[-1].weight.mul_(0.01)

    def forward(self, obs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked logits (B, C + 1), terminate last, and values (B,)."""
        full_c = obs["cand_mask"].shape[1]
        mask = action_mask_from_obs(obs)
        obs = trim(obs)
        nodes, graph = self.encoder(obs)
        b, n, h = nodes.shape
        c = max(int(obs["cand_mask"].sum(-1).max().item()), 1)
        touched = obs["cand_nodes"][:, :c].long()  # (B, c, K), -1 for none
        valid = (touched >= 0) & (touched < n)
        gathered = torch.gather(nodes, 1, touched.clamp(0, n - 1).reshape(b, c * MAX_TOUCHED, 1).expand(-1, -1, h))
        gathered = gathered.reshape(b, c, MAX_TOUCHED, h) * valid.unsqueeze(-1)
        root = gathered[:, :, 0]
        touched_mean = gathered.sum(2) / valid.sum(-1, keepdim=True).clamp_min(1)
        rule = self.rule_embed(obs["cand_rule"][:, :c].long().clamp(0, self.rule_embed.num_embeddings - 1))
        features = torch.cat([rule, root, touched_mean, graph.unsqueeze(1).expand(-1, c, -1)], -1)
        logits = torch.full((b, full_c + 1), NEG, dtype=nodes.dtype, device=nodes.device)
        logits[:, :c] = self.score(features).squeeze(-1)
        logits[:, -1] = self.stop(graph).squeeze(-1)
        logits = torch.where(mask, logits, torch.full_like(logits, NEG))
        return logits, self.critic(graph).squeeze(-1)

    def get_value(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Values (B,)."""
        return self.forward(obs)[1]

    def get_action_and_value(self, obs: Mapping[str, torch.Tensor], action: torch.Tensor | None = None,
                             greedy: bool = False):
        """CleanRL's interface: (action, log-probability, entropy, value), each (B,); samples unless `action` is
        given (then scores it) or `greedy` (then takes the most likely valid action)."""
        logits, value = self.forward(obs)
        dist = Categorical(logits=logits)
        if action is None:
            action = logits.argmax(-1) if greedy else dist.sample()
        return action, dist.log_prob(action), masked_entropy(logits), value


def masked_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (B,) over the valid actions only (masked logits contribute exactly 0)."""
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    valid = logits > NEG / 2
    return -(torch.where(valid, p * logp, torch.zeros_like(p))).sum(-1)


# ------------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: str | os.PathLike, policy: CandidatePolicy, optimizer: torch.optim.Optimizer | None = None,
                    config: dict | None = None, **extra) -> Path:
    """Writes weights, optimiser state, config and the rule-registry and observation versions (atomically)."""
    from rlflow.rewrites import REGISTRY_VERSION, RULES

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "registry_version": REGISTRY_VERSION,
        "rules": [r.name for r in RULES],
        "obs_version": OBS_VERSION,
        "policy": {"n_rules": policy.n_rules, "hidden": policy.hidden, "rounds": policy.n_rounds},
        "model": policy.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "config": dict(config or {}),
        **extra,
    }
    return save_checkpoint_atomic(payload, path)


def load_checkpoint(path: str | os.PathLike, registry_version: str | None = None,
                    prefix: bool = False) -> tuple[CandidatePolicy, dict]:
    """The policy stored at `path` and the whole checkpoint dictionary (`prefix`: see
    `rlflow.agents.checkpoint.load_checkpoint_payload`).

    Raises:
        RlflowError: the file is missing or not a checkpoint, or it was trained on another rule registry or
            observation version than this rlflow's (rule ids would mean other rules).
    """
    payload = load_checkpoint_payload(path, fmt=CHECKPOINT_FORMAT, registry_version=registry_version,
                                      retrain="retrain the policy (rlflow train --algo ppo) or use the rlflow "
                                              "version it was trained with", prefix=prefix)
    policy = CandidatePolicy(**payload["policy"])
    policy.load_state_dict(payload["model"])
    policy.config = dict(payload["config"])  # the training run's settings: the agent search plays its scope
    return policy, payload


__all__ = ["CandidatePolicy", "action_mask_from_obs", "masked_entropy", "save_checkpoint",
           "load_checkpoint", "CHECKPOINT_FORMAT"]
