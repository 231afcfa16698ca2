"""One real episode of the world-model agent's training, played and recorded in the replay (`real_episode`): random
rule-level actions (count-based: `explore_action`), or the controller with epsilon exploration, each rule placed where
the location scorer rates best or, exploring, at a random match.  `collect` plays them for an iteration's experience,
`evaluate_real` greedily, once per model; apart from the training loop (`rlflow.train.worldmodel.loop`) because how
episodes are played is its own concern.
"""
from __future__ import annotations

import dataclasses
import typing

import numpy as np

from rlflow.agents.worldmodel_agent import Agent, Memory, Planning

if typing.TYPE_CHECKING:
    from rlflow.train.worldmodel.config import Config


def explore_action(rules: np.ndarray, state: int, tried: dict | None, rng: np.random.Generator,
                   random_terminate: float, terminate: int, matches: np.ndarray | None = None) -> int:
    """An exploratory action: terminate with probability `random_terminate` (or when no rule is available), else a
    random rule among the available `rules` least tried from `state` so far (`tried`: (state, rule) -> count; all
    equally when None): count-based exploration, so that the deterministic environment's recurring graphs have
    every rewrite tried before any is tried twice.  With `matches` ((R,) listed matches per rule) the draw is in
    proportion to them (`rlflow.train.worldmodel.config.Config.explore_by_match`), else uniform."""
    if len(rules) == 0 or rng.random() < random_terminate:
        return terminate
    if tried is not None:
        counts = np.array([tried.get((state, int(r)), 0) for r in rules])
        rules = rules[counts == counts.min()]
    if matches is None:
        return int(rng.choice(rules))
    weights = np.asarray(matches, float)[rules]
    return int(rng.choice(rules, p=weights / weights.sum()))


def tried_pairs(episodes: list) -> dict:
    """(state, rule) -> how often `episodes` applied that rule to that state."""
    tried: dict = {}
    for e in episodes:
        for s, a in zip(e.states, e.actions):
            tried[(s, a)] = tried.get((s, a), 0) + 1
    return tried


def real_episode(env, model_index: int, agent: Agent | None, replay, rng: np.random.Generator, *, greedy: bool,
                 epsilon: float = 0.0, random_terminate: float = 0.1, heldout: bool = False, source: str = "random",
                 iteration: int = 0, max_steps: int | None = None, tried: dict | None = None,
                 random_locations: bool = False, avoid_revisits: bool = False, explore_by_match: bool = False,
                 planning=None):
    """One real episode with rule-level actions (random when `agent` is None, see `explore_action`), recorded in
    `replay`; `tried` counts the (state, rule) pairs applied and is updated.  A rule goes where the agent's location
    scorer rates best; random and exploratory actions go to a random match when `random_locations` is set (marked
    as such where the rule had more than one), and everything goes to the first listed match when there is no
    scorer.  With `avoid_revisits` the controller's
    choices never lead back to a graph of the episode (`rlflow.agents.unvisited`): where its rule at that match
    would, it takes its next choice, as `rlflow optimize` plays the agent.  `explore_by_match`: random rules are
    drawn in proportion to their listed matches (`explore_action`).  `planning` (`rlflow.agents.worldmodel_agent.Planning`):
    a greedy episode takes the rule M predicts to pay most instead of the controller's argmax.

    Returns:
        The `Episode` (also appended to `replay.episodes`).
    """
    import torch

    from rlflow.agents.unvisited import choose_unvisited
    from rlflow.env.observation import first_candidate, rule_mask_from_obs, rule_match_counts
    from rlflow.train.worldmodel.replay import Episode
    from rlflow.worldmodel.location import candidate_logits, choose_location, describe_match

    n_rules = replay.n_rules
    obs, info = env.reset(options={"model": model_index})
    episode = Episode(model=info["model"], heldout=heldout, source=source, iteration=iteration)
    memory = Memory(agent, planning if greedy else None) if agent is not None else None
    seen = {env.fingerprint} if avoid_revisits else None
    done = False
    while not done:
        counts = rule_match_counts(obs, n_rules)
        mask = np.append(counts > 0, True)
        episode.states.append(replay.add_state(obs, mask))
        rules = np.flatnonzero(mask[:n_rules])
        explored = agent is None or (epsilon > 0 and rng.random() < epsilon)
        env_action = None
        if explored:
            action = explore_action(rules, episode.states[-1], tried, rng, random_terminate, n_rules,
                                    counts if explore_by_match else None)
        else:
            with torch.no_grad():
                latent_state, rule_mask = memory.controller_input(obs)
                if seen is None and memory.planning is None:
                    chosen, *_ = agent.policy.get_action_and_value(latent_state, rule_mask, greedy=greedy)
                    action = int(chosen.item())
                elif seen is None:  # planning in M (greedy episodes only)
                    action = int(memory.greedy_rule_scores(obs).argmax())
                else:
                    per_rule = (memory.greedy_rule_scores(obs) if greedy
                                else agent.policy.logits(latent_state, rule_mask)[0])
                    env_action = choose_unvisited(env, candidate_logits(per_rule, obs, agent.location), seen,
                                                  greedy=greedy)
                    action = (n_rules if env_action == env.terminate_action
                              else int(np.asarray(obs["cand_rule"])[env_action]))
        scorer = agent.location if agent is not None else None
        # a rule with one match leaves no choice: its step is the agent's kind too (bit 0), which grounds the
        # dream's kind of step from the first, all-random iteration on
        random_location = bool(action != n_rules and explored and random_locations
                               and counts[action] > 1)
        if env_action is None:  # not yet placed by the choice that avoids revisits
            if action == n_rules:
                env_action = env.terminate_action
            elif random_location or scorer is not None:
                env_action = choose_location(obs, action, scorer, rng, explore=random_location)
            else:
                env_action = first_candidate(obs, action)
        match = ([int(n) for n in np.asarray(obs["cand_nodes"])[env_action] if n >= 0] if action != n_rules else [])
        if agent is not None and action != n_rules:
            where = torch.zeros(1 + agent.mdrnn.match_features)
            where[0] = float(random_location)
            if random_location and agent.mdrnn.match_features:
                where[1:] = describe_match(scorer, obs, action, match, agent.mdrnn.match_features)
        before = obs
        obs, reward, terminated, truncated, info = env.step(env_action)
        episode.actions.append(int(action))
        episode.locations.append(match)
        episode.random_locations.append(random_location)
        episode.rewards.append(float(reward))
        if seen is not None:
            seen.add(env.fingerprint)
        if tried is not None:
            tried[(episode.states[-1], int(action))] = tried.get((episode.states[-1], int(action)), 0) + 1
        if agent is not None and action != n_rules:
            memory.step(action, before, where.unsqueeze(0))
        done = terminated or truncated or (max_steps is not None and len(episode.actions) >= max_steps)
        if done:
            episode.states.append(replay.add_state(obs, rule_mask_from_obs(obs, n_rules)))
            episode.ended_empty = bool(terminated and action != n_rules)
            episode.truncated = bool(truncated)
    replay.episodes.append(episode)
    return episode


def collect(env, agent: Agent | None, replay, steps: int, config: Config, rng: np.random.Generator, *,
            iteration: int, progress=None) -> list:
    """Real episodes, models in turn, until `steps` real steps: random (agent None) or the controller with
    epsilon exploration (sampled actions)."""
    episodes, taken = [], 0
    tried = tried_pairs(replay.episodes) if config.explore_untried else None
    while taken < steps:
        index = len(replay.episodes) % len(env.models)
        heldout = bool(rng.random() < config.heldout_fraction)
        ep = real_episode(env, index, agent, replay, rng, greedy=False, epsilon=config.explore_epsilon,
                          random_terminate=config.random_terminate, heldout=heldout,
                          source="random" if agent is None else "controller", iteration=iteration, tried=tried,
                          random_locations=config.learn_location, explore_by_match=config.explore_by_match)
        episodes.append(ep)
        taken += len(ep.actions)
        if progress is not None:
            progress.update(len(ep.actions))
    return episodes


def evaluate_real(env, agent: Agent, replay, config: Config, rng: np.random.Generator, iteration: int,
                  reward_range: tuple | None = None) -> list:
    """One greedy episode per model in the real environment (recorded: they are real experience too), never
    returning to a graph of the episode when `config.avoid_revisits` is set, choosing as `config.greedy_by` says
    (`reward_range`: the dream's clip, for planning in M)."""
    planning = Planning.of(dataclasses.asdict(config), reward_range)
    return [real_episode(env, index, agent, replay, rng, greedy=True,
                         heldout=bool(rng.random() < config.heldout_fraction), source="eval", iteration=iteration,
                         avoid_revisits=config.avoid_revisits, planning=planning)
            for index in range(len(env.models))]


__all__ = ["collect", "evaluate_real", "explore_action", "real_episode", "tried_pairs"]
