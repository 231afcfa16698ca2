"""A finished world-model run's quality figures, recomputed from its checkpoint.

The checkpoint holds V, M, the location scorer and the replay as they stood after the last iteration, so the figures
`rlflow.train.worldmodel.quality.quality` gave then can be computed again, with any figure added to it since (such as
`reward_spearman_moved`) beside them: benchmarks/agent-deploy/requality.py does so for runs already made.  Apart
from `report` because it loads agents, which `report` must not import (the agent's modules use its correlations).
"""
from __future__ import annotations

from rlflow.agents.worldmodel_agent import load_checkpoint
from rlflow.train.worldmodel.quality import encode_all, quality
from rlflow.train.worldmodel.replay import Replay
from rlflow.worldmodel.location import match_descriptors


def checkpoint_inputs(path) -> tuple:
    """The world-model run checkpointed at `path`, as its last iteration's training and figures saw it: (agent, the
    checkpoint, its replay, V's posteriors (mu, logvar) of every replay state, M's descriptions of the random
    matches of every episode)."""
    agent, payload = load_checkpoint(path, optimisers=False)
    replay = Replay.from_state_dict(payload["replay"])
    mu, logvar = encode_all(agent.vision, replay)
    descriptors = (match_descriptors(agent.location, replay, replay.episodes, agent.mdrnn.match_features)
                   if agent.mdrnn.match_features else None)
    return agent, payload, replay, mu, logvar, descriptors


def last_figures_episodes(replay: Replay, payload: dict) -> tuple[list, list]:
    """(held-out, training) episodes of a checkpointed run as its last figures saw them: the last iteration's greedy
    evaluation episodes came after its figures, and are left out."""
    then = [e for e in replay.episodes if not (e.source == "eval" and e.iteration == payload["iteration"])]
    return [e for e in then if e.heldout], [e for e in then if not e.heldout]


def checkpoint_quality(path) -> tuple[dict, dict]:
    """`quality` of the run checkpointed at `path`, recomputed (it includes figures added since the run), and the
    figures the run reported after its last iteration (benchmarks/agent-deploy/requality.py).  The last
    iteration's greedy evaluation episodes are left out (`last_figures_episodes`)."""
    agent, payload, replay, mu, logvar, descriptors = checkpoint_inputs(path)
    held, train = last_figures_episodes(replay, payload)
    figures = quality(agent.vision, agent.mdrnn, replay, held, train, mu, logvar, payload["config"]["reward_scale"],
                      descriptors)
    return figures, payload["history"][-1]


__all__ = ["checkpoint_inputs", "checkpoint_quality", "last_figures_episodes"]
