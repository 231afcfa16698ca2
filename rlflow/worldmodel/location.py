"""The learned location choice: where in the graph a rule chosen by the controller is applied.

The controller acts over rule types (the dream has no candidate list), so something must pick one of the rule's
real matches.  A fixed heuristic (the first listed match) caps what the agent can reach: on nasrnn-tiny, for
example, which pair of sibling MatMuls is merged first decides what later merges pay.  `LocationScorer` predicts
the reward of applying a rule at one match from the real graph (its own message-passing encoder, the mean of the
match's node embeddings, the graph embedding and a learned embedding of the rule) and is trained by regression on
the real transitions (each records the nodes of the match it applied).  In the real environment the rule is applied
at its best-scored match; exploration, and the first iteration before any scorer is trained, pick a match at random,
so that the scorer sees every kind of location.  The world model's reward for a rule is then the reward at the
location the agent really picks, which is what its training transitions record.

A reward alone is short-sighted: two matches of a rule can pay the same now and very differently later (two MatMul
merges on nasrnn-tiny pay 10.25% each; after one of them a Gemm fusion pays 8.4%, after the other nothing).
Trained with `gamma` > 0, the scorer's target is the reward plus `gamma` times the best return the real transitions
show after it (`best_returns`: value iteration over the graph of the states the episodes visited, which the
deterministic environment makes exact for what was seen), so it prefers the match that opens more.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

from rlflow.env.observation import NEG, obs_to_torch, rule_candidates
from rlflow.worldmodel.encoder import GraphEncoder, trim


class LocationScorer(nn.Module):
    """Predicted reward (divided by the reward scale; with a `gamma` in training, the reward plus the discounted best
    return seen after it) of applying rule r at a match touching nodes m.

    Args:
        n_rules: size of the rule registry.
        hidden: encoder width.
        rounds: message-passing rounds.
    """

    def __init__(self, n_rules: int, hidden: int = 64, rounds: int = 3):
        super().__init__()
        self.n_rules, self.hidden, self.n_rounds = n_rules, hidden, rounds
        self.encoder = GraphEncoder(hidden, rounds)
        self.rule_embed = nn.Embedding(n_rules, hidden)
        self.head = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def spec(self) -> dict:
        """Constructor arguments (stored in checkpoints)."""
        return {"n_rules": self.n_rules, "hidden": self.hidden, "rounds": self.n_rounds}

    def forward(self, obs: Mapping[str, torch.Tensor], graph_index: torch.Tensor, rules: torch.Tensor,
                nodes: torch.Tensor) -> torch.Tensor:
        """Scores K (graph, rule, match) triples.

        Args:
            obs: a batch of B observations (encoder keys).
            graph_index: (K,) long, which graph of the batch each match is in.
            rules: (K,) long rule ids.
            nodes: (K, M) long node indices of each match, -1 padding (at least one real index per row).

        Returns:
            (K,) predicted rewards (reward units / reward scale).
        """
        return self.describe(obs, graph_index, rules, nodes)[:, 0]

    def describe(self, obs: Mapping[str, torch.Tensor], graph_index: torch.Tensor, rules: torch.Tensor,
                 nodes: torch.Tensor) -> torch.Tensor:
        """(K, 1 + hidden): each match's predicted reward (as `forward`) followed by the mean of its nodes'
        embeddings (what the prediction is read from; arguments as `forward`)."""
        node_emb, graph_emb = self.encoder(trim(obs))
        real = (nodes >= 0).float().unsqueeze(-1)
        picked = node_emb[graph_index.unsqueeze(-1), nodes.clamp(0, node_emb.shape[1] - 1)]  # (K, M, H)
        local = (picked * real).sum(1) / real.sum(1).clamp_min(1.0)
        x = torch.cat([local, graph_emb[graph_index], self.rule_embed(rules)], -1)
        return torch.cat([self.head(x), local], -1)


@torch.no_grad()
def candidate_scores(scorer: LocationScorer, obs: Mapping[str, np.ndarray], candidates: np.ndarray) -> torch.Tensor:
    """(len(candidates),) the scorer's predicted rewards of the given candidates of a real observation."""
    scorer.eval()
    rules = torch.as_tensor(np.asarray(obs["cand_rule"])[candidates], dtype=torch.long)
    nodes = torch.as_tensor(np.asarray(obs["cand_nodes"])[candidates], dtype=torch.long)
    return scorer(obs_to_torch(obs), torch.zeros(len(candidates), dtype=torch.long), rules, nodes)


LOCATION_TEMPERATURE = 0.1
"""Spread of the location distribution, in the scorer's units (reward / reward scale): matches whose predicted
rewards differ by one percentage point (0.1 at the usual scale of 10) differ by a factor e in probability."""


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


def choose_location(obs: Mapping[str, np.ndarray], rule: int, scorer: LocationScorer | None,
                    rng: np.random.Generator, explore: bool) -> int:
    """The candidate index at which to apply `rule`: the best-scored match, or a uniformly random one when
    `explore` is set or no scorer is trained yet.

    Raises:
        ValueError: the rule has no listed candidate.
    """
    candidates = rule_candidates(obs, rule)
    if not len(candidates):
        raise ValueError(f"rule {rule} has no listed candidate")
    if len(candidates) == 1:
        return int(candidates[0])
    if explore or scorer is None:
        return int(rng.choice(candidates))
    return int(candidates[int(torch.argmax(candidate_scores(scorer, obs, candidates)))])


def best_returns(episodes: list, n_rules: int, gamma: float, sweeps: int = 200) -> dict[int, float]:
    """State id -> the best discounted return the real transitions of `episodes` show from that state (at least 0:
    terminate is always allowed).  The environment is deterministic, so the transitions form one graph over states
    and value iteration on it gives, for each state, the best continuation seen from it in any episode."""
    edges: dict[int, dict] = {}
    for e in episodes:
        for t, (s, a, r) in enumerate(zip(e.states, e.actions, e.rewards)):
            if a < n_rules and t + 1 < len(e.states):
                edges.setdefault(s, {})[(a, tuple(e.locations[t]) if e.locations else ())] = (r, e.states[t + 1])
    values: dict[int, float] = {}
    for _ in range(sweeps):
        new = {s: max(0.0, max(r + gamma * values.get(nxt, 0.0) for r, nxt in out.values()))
               for s, out in edges.items()}
        converged = all(abs(new[s] - values.get(s, 0.0)) < 1e-9 for s in new)
        values = new
        if converged:
            break
    return values


def location_transitions(episodes: list, n_rules: int, gamma: float = 0.0,
                         values: dict[int, float] | None = None) -> list[tuple[int, int, list[int], float]]:
    """(state id, rule, match nodes, target) of every rule transition of `episodes` that recorded its match; the
    target is the transition's reward plus `gamma` times the best return seen from the state it led to (`values`,
    from `best_returns` over `episodes` when None)."""
    if gamma > 0 and values is None:
        values = best_returns(episodes, n_rules, gamma)
    rows = []
    for e in episodes:
        for t, (s, a, r, nodes) in enumerate(zip(e.states, e.actions, e.rewards, e.locations)):
            if a < n_rules and nodes:
                after = gamma * values.get(e.states[t + 1], 0.0) if gamma > 0 and t + 1 < len(e.states) else 0.0
                rows.append((s, a, nodes, r + after))
    return rows


def score_transitions(scorer: LocationScorer, replay, rows: list, describe: bool = False) -> torch.Tensor:
    """(len(rows),) predicted rewards (scaled) of `location_transitions` rows; with `describe`, (len(rows),
    1 + hidden) descriptions (`LocationScorer.describe`)."""
    ids = sorted({s for s, *_ in rows})
    where = {s: i for i, s in enumerate(ids)}
    width = max(len(nodes) for _, _, nodes, _ in rows)
    nodes = torch.full((len(rows), width), -1, dtype=torch.long)
    for k, (_, _, match, _) in enumerate(rows):
        nodes[k, : len(match)] = torch.as_tensor(match)
    call = scorer.describe if describe else scorer
    return call(replay.batch(ids), torch.as_tensor([where[s] for s, *_ in rows]),
                torch.as_tensor([a for _, a, _, _ in rows]), nodes)


MATCH_INPUTS = {"none": 0, "score": 1, "embedding": None}
"""What M reads about a random match (`Config.match_input`) -> how many numbers (None: 1 + the scorer's width)."""


def match_width(match_input: str, hidden: int) -> int:
    """How many numbers describe a random match to M for `match_input` ("none", "score" or "embedding")."""
    if match_input not in MATCH_INPUTS:
        raise ValueError(f"match_input must be one of {', '.join(MATCH_INPUTS)}, not {match_input!r}")
    width = MATCH_INPUTS[match_input]
    return 1 + hidden if width is None else width


@torch.no_grad()
def match_descriptors(scorer: LocationScorer, replay, episodes: list, width: int,
                      chunk: int = 256) -> dict[int, torch.Tensor]:
    """id(episode) -> (steps, width): what M reads about the match of each step that went to a random one (the
    first `width` numbers of `LocationScorer.describe`: its rating, then its embedding of the matched nodes); zeros
    on every other step.  Recomputed whenever the scorer changes, as the latents are whenever V does."""
    out = {id(e): torch.zeros(len(e.actions), width) for e in episodes}
    steps = [(e, t) for e in episodes for t, random in enumerate(e.random_locations) if random and e.locations[t]]
    if not width or not steps:
        return out
    scorer.eval()
    for begin in range(0, len(steps), chunk):
        part = steps[begin: begin + chunk]
        rows = [(e.states[t], e.actions[t], e.locations[t], 0.0) for e, t in part]
        described = score_transitions(scorer, replay, rows, describe=True)[:, :width]
        for (e, t), row in zip(part, described):
            out[id(e)][t] = row
    return out


@torch.no_grad()
def describe_match(scorer: LocationScorer, obs: Mapping[str, np.ndarray], rule: int, match: list[int],
                   width: int) -> torch.Tensor:
    """(width,) what M reads about one random match of a real observation (as `match_descriptors`)."""
    scorer.eval()
    described = scorer.describe(obs_to_torch(obs), torch.zeros(1, dtype=torch.long), torch.tensor([rule]),
                                torch.as_tensor([match], dtype=torch.long))
    return described[0, :width]


def train_location(scorer: LocationScorer, optimizer: torch.optim.Optimizer, replay, episodes: list, epochs: int,
                   batch: int, reward_scale: float, rng: np.random.Generator, progress=None,
                   gamma: float = 0.0) -> dict:
    """Epochs of squared-error regression of the scorer on the real transitions of `episodes` (targets: see
    `location_transitions`); returns the last epoch's mean loss (`location_mse`, scaled units) and the transition
    count."""
    rows = location_transitions(episodes, scorer.n_rules, gamma)
    if not rows:
        return {"location_mse": float("nan"), "transitions": 0}
    scorer.train()
    loss_sum, batches = 0.0, 0
    for _ in range(epochs):
        loss_sum, batches = 0.0, 0
        order = rng.permutation(len(rows))
        for begin in range(0, len(rows), batch):
            chunk = [rows[i] for i in order[begin: begin + batch]]
            target = torch.as_tensor([r for *_, r in chunk], dtype=torch.float32) / reward_scale
            loss = (score_transitions(scorer, replay, chunk) - target).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(scorer.parameters(), 5.0)
            optimizer.step()
            loss_sum, batches = loss_sum + float(loss.detach()), batches + 1
        if progress is not None:
            progress.update(1)
            progress.set_postfix(mse=f"{loss_sum / max(batches, 1):.3f}")
    scorer.eval()
    return {"location_mse": loss_sum / max(batches, 1), "transitions": len(rows)}


@torch.no_grad()
def location_quality(scorer: LocationScorer, replay, episodes: list, reward_scale: float, gamma: float = 0.0,
                     values: dict[int, float] | None = None) -> dict:
    """The scorer on held-out `episodes`: Pearson correlation and mean absolute error of its predicted vs the real
    target of the matches applied (`location_pearson`, `location_mae`, `location_transitions`; the reward, plus
    `gamma` times the best return `values` records after it)."""
    from rlflow.measure.ranks import pearson

    rows = location_transitions(episodes, scorer.n_rules, gamma, values)
    if not rows:
        return {"location_transitions": 0}
    scorer.eval()
    predicted = score_transitions(scorer, replay, rows).numpy() * reward_scale
    real = np.array([r for *_, r in rows])
    return {"location_pearson": pearson(predicted, real), "location_mae": float(np.mean(np.abs(predicted - real))),
            "location_transitions": len(rows)}


__all__ = ["LOCATION_TEMPERATURE", "LocationScorer", "MATCH_INPUTS", "best_returns", "candidate_logits",
           "candidate_scores", "choose_location", "describe_match", "location_preference", "location_quality",
           "location_transitions", "match_descriptors", "match_width", "score_transitions", "train_location"]
