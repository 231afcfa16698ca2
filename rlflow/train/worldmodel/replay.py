"""Real experience for the world model: observations (deduplicated), episodes of rule-level actions, batching.

A state keeps only what the graph encoder reads (`node_*`, `edge_*`, `graph`), cut to its real node and edge counts,
plus its per-rule availability (which rules have a listed candidate).  Identical states (the environment is
deterministic, so episodes revisit graphs) are stored once.  Each episode is marked held out or not when it is
recorded; held-out episodes never train V or M and serve to measure them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

ENCODER_KEYS = ("node_op", "node_features", "node_mask", "edge_index", "edge_features", "edge_mask", "graph")
_NODE_KEYS = ("node_op", "node_features", "node_mask")
_EDGE_KEYS = ("edge_index", "edge_features", "edge_mask")


@dataclass
class Episode:
    """One real episode: states s_0..s_L (indices into the replay), actions a_0..a_{L-1} (rule ids, or the terminate
    id), rewards, the node indices of the match each rule was applied at (`locations`, [] for terminate; what the
    location scorer learns from), whether that match was a random one (`random_locations`: exploration, not the
    agent's location choice) and how it ended.  `ended_empty`: it ended because no rewrite was left (the world
    model's termination target)."""

    model: str
    states: list[int] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    locations: list[list[int]] = field(default_factory=list)
    random_locations: list[bool] = field(default_factory=list)
    ended_empty: bool = False
    truncated: bool = False
    heldout: bool = False
    source: str = "random"
    iteration: int = 0

    @property
    def ret(self) -> float:
        return float(sum(self.rewards))


class Replay:
    """Deduplicated states and the episodes through them.

    Args:
        n_rules: size of the rule registry (availability vectors).
    """

    def __init__(self, n_rules: int):
        self.n_rules = n_rules
        self.states: list[dict[str, np.ndarray]] = []
        self.rule_masks: list[np.ndarray] = []
        self.episodes: list[Episode] = []
        self._index: dict[str, int] = {}
        self._digests: list[str] = []  # state index -> its digest (what identifies a state across replays)

    def add_state(self, obs, rule_mask: np.ndarray) -> int:
        """Stores a real observation (once) and returns its index."""
        n = max(int(np.asarray(obs["node_mask"]).sum()), 1)
        e = max(int(np.asarray(obs["edge_mask"]).sum()), 1)
        state = {}
        for key in ENCODER_KEYS:
            value = np.asarray(obs[key])
            cut = n if key in _NODE_KEYS else e if key in _EDGE_KEYS else None
            state[key] = value[:cut].copy() if cut is not None else value.copy()
        digest = hashlib.sha1()
        for key in ENCODER_KEYS:
            digest.update(state[key].tobytes())
        key = digest.hexdigest()
        if key not in self._index:
            self._index[key] = len(self.states)
            self._digests.append(key)
            self.states.append(state)
            self.rule_masks.append(np.asarray(rule_mask[: self.n_rules], bool).copy())
        return self._index[key]

    def digest(self, index: int) -> str:
        """The digest of state `index`: the same state has the same digest in every replay (`rlflow.train.cluster`
        plays episodes into a replay of their own and merges them here)."""
        return self._digests[index]

    def split(self, heldout: bool) -> list[Episode]:
        return [e for e in self.episodes if e.heldout == heldout]

    def state_ids(self, episodes: list[Episode]) -> list[int]:
        """Unique state indices visited by `episodes`."""
        return sorted({s for e in episodes for s in e.states})

    def batch(self, ids) -> dict[str, torch.Tensor]:
        """Padded encoder input for states `ids` (batch B, padded to the largest node and edge counts)."""
        states = [self.states[i] for i in ids]
        n = max(len(s["node_op"]) for s in states)
        e = max(len(s["edge_mask"]) for s in states)
        out = {}
        for key in ENCODER_KEYS:
            first = states[0][key]
            if key in _NODE_KEYS or key in _EDGE_KEYS:
                size = n if key in _NODE_KEYS else e
                array = np.zeros((len(states), size, *first.shape[1:]), first.dtype)
                for row, s in enumerate(states):
                    array[row, : len(s[key])] = s[key]
            else:
                array = np.stack([s[key] for s in states])
            out[key] = torch.as_tensor(array)
        return out

    def masks(self, ids) -> torch.Tensor:
        """(B, R) per-rule availability of states `ids`."""
        return torch.as_tensor(np.stack([self.rule_masks[i] for i in ids]))

    def reward_table(self, episodes: list[Episode], reward_scale: float) -> dict[int, dict[int, float]]:
        """state -> {rule: reward / reward_scale} observed in `episodes` (the environment is deterministic; repeated
        observations are averaged)."""
        sums: dict[int, dict[int, list[float]]] = {}
        for e in episodes:
            for s, a, r in zip(e.states, e.actions, e.rewards):
                if a < self.n_rules:
                    sums.setdefault(s, {}).setdefault(a, []).append(r / reward_scale)
        return {s: {a: sum(v) / len(v) for a, v in rules.items()} for s, rules in sums.items()}

    def reward_targets(self, ids, table: dict[int, dict[int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, R) reward targets and (B, R) known flags of states `ids` from a `reward_table`."""
        target = torch.zeros(len(ids), self.n_rules)
        known = torch.zeros(len(ids), self.n_rules)
        for row, s in enumerate(ids):
            for a, r in table.get(s, {}).items():
                target[row, a], known[row, a] = r, 1.0
        return target, known

    def state_dict(self) -> dict:
        return {"n_rules": self.n_rules, "states": self.states, "rule_masks": self.rule_masks,
                "episodes": [vars(e) for e in self.episodes], "index": self._index}

    @classmethod
    def from_state_dict(cls, data: dict) -> "Replay":
        replay = cls(data["n_rules"])
        replay.states, replay.rule_masks = data["states"], data["rule_masks"]
        replay.episodes = [Episode(**e) for e in data["episodes"]]
        replay._index = data["index"]
        replay._digests = sorted(replay._index, key=replay._index.get)
        return replay


def sequences(episodes: list[Episode], mu: torch.Tensor, logvar: torch.Tensor, masks: torch.Tensor,
              terminate: int, sample: bool, reward_scale: float,
              descriptors: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Padded training sequences for the MDN-RNN (T = longest episode + 1, B = episodes).

    Step t of an episode holds state s_t, action a_t and the transition's targets; one extra step holds the last
    state (its action is a placeholder, only its availability is a target).  Terminate steps carry no transition
    target (the dream handles terminate exactly).

    Args:
        episodes: the episodes.
        mu, logvar: (S, Z) posteriors of every replay state.
        masks: (S, R) availability of every replay state.
        terminate: the terminate action id.
        sample: sample z from the posteriors (training) or take the means (evaluation).
        reward_scale: rewards are divided by it.
        descriptors: id(episode) -> (steps, F) descriptions of the random matches
            (`rlflow.worldmodel.location.match_descriptors`); None: no description.

    Returns:
        `actions` (T, B) long, `latents` and `next_latents` (T, B, Z), `rewards`, `dones`, `valid` (transition
        targets), `state_valid` (T, B), `flags` (T, B; 1 where the rule went to a random match; with
        `descriptors`, (T, B, 1 + F): the bit, then the description), `masks` (T, B, R).
    """
    t_max = max(len(e.states) for e in episodes)
    b, z, r = len(episodes), mu.shape[1], masks.shape[1]
    out = {"actions": torch.full((t_max, b), terminate, dtype=torch.long), "latents": torch.zeros(t_max, b, z),
           "next_latents": torch.zeros(t_max, b, z), "rewards": torch.zeros(t_max, b), "dones": torch.zeros(t_max, b),
           "valid": torch.zeros(t_max, b), "state_valid": torch.zeros(t_max, b), "masks": torch.zeros(t_max, b, r),
           "flags": torch.zeros(t_max, b)}
    width = next(iter(descriptors.values())).shape[-1] if descriptors else 0
    described = torch.zeros(t_max, b, width)
    for col, ep in enumerate(episodes):
        ids = torch.as_tensor(ep.states)
        lat = mu[ids] + (0.5 * logvar[ids]).exp() * torch.randn(len(ids), z) if sample else mu[ids]
        length = len(ep.states)
        out["latents"][:length, col] = lat
        out["masks"][:length, col] = masks[ids].float()
        out["state_valid"][:length, col] = 1.0
        steps = len(ep.actions)
        if steps:
            out["actions"][:steps, col] = torch.as_tensor(ep.actions)
            out["next_latents"][:steps, col] = lat[1: steps + 1]
            out["rewards"][:steps, col] = torch.as_tensor(ep.rewards, dtype=torch.float32) / reward_scale
            if ep.random_locations:
                out["flags"][:steps, col] = torch.as_tensor(ep.random_locations, dtype=torch.float32)
            if descriptors is not None:
                described[:steps, col] = descriptors[id(ep)]
            acts = torch.as_tensor(ep.actions)
            out["valid"][:steps, col] = (acts != terminate).float()
            if ep.ended_empty and ep.actions[-1] != terminate:
                out["dones"][steps - 1, col] = 1.0
    if descriptors is not None:
        out["flags"] = torch.cat([out["flags"].unsqueeze(-1), described], -1)
    return out


__all__ = ["ENCODER_KEYS", "Episode", "Replay", "sequences"]
