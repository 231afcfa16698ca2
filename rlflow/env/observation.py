"""Reading the environment's observation (`rlflow.env.rewrite_env.RewriteEnv`, arrays from `rlflow.env.features`): as torch tensors,
and which rules have a listed candidate where.

Both the world model (`rlflow.worldmodel`) and the agents and their trainers (`rlflow.agents`, `rlflow.train`) read observations;
these helpers sit below both, so that neither package imports the other for them.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

NEG = -1e8
"""Logit of an action that cannot be taken."""

_RANK = {"node_op": 1, "node_features": 2, "node_mask": 1, "edge_index": 2, "edge_features": 2, "edge_mask": 1,
         "cand_rule": 1, "cand_nodes": 2, "cand_mask": 1, "graph": 1}


def obs_to_torch(obs: Mapping[str, np.ndarray], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One observation (no batch dimension) or a stacked batch -> tensors with a batch dimension."""
    out = {}
    for key, value in obs.items():
        tensor = torch.as_tensor(np.asarray(value), device=device)
        out[key] = tensor.unsqueeze(0) if tensor.dim() == _RANK[key] else tensor
    return out


def rule_match_counts(obs: Mapping[str, np.ndarray], n_rules: int) -> np.ndarray:
    """(n_rules,) how many listed candidates each rule has in a real observation."""
    rules = np.asarray(obs["cand_rule"])[np.asarray(obs["cand_mask"]).astype(bool)]
    return np.bincount(rules[rules < n_rules], minlength=n_rules)


def rule_mask_from_obs(obs: Mapping[str, np.ndarray], n_rules: int) -> np.ndarray:
    """(n_rules + 1,) bool: the rules with a listed candidate in a real observation, and terminate."""
    return np.append(rule_match_counts(obs, n_rules) > 0, True)


def rule_candidates(obs: Mapping[str, np.ndarray], rule: int) -> np.ndarray:
    """Indices of the listed candidates of `rule` in a real observation (find_matches order)."""
    listed = np.asarray(obs["cand_mask"]).astype(bool)
    return np.flatnonzero(listed & (np.asarray(obs["cand_rule"]) == rule))


def first_candidate(obs: Mapping[str, np.ndarray], rule: int) -> int:
    """The location heuristic: the index of the first listed candidate of `rule` (find_matches order)."""
    hits = rule_candidates(obs, rule)
    if not len(hits):
        raise ValueError(f"rule {rule} has no listed candidate")
    return int(hits[0])


__all__ = ["NEG", "first_candidate", "obs_to_torch", "rule_candidates", "rule_mask_from_obs", "rule_match_counts"]
