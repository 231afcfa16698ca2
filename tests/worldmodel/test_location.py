"""The learned location choice: the scorer learns which match of a rule pays, and the agent plays it."""
from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def graph_with_a_repeated_rule(tiny_model, wm_cost_model):
    """A real observation of resnet-18-tiny and a rule with several listed matches there."""
    from rlflow.env.observation import rule_candidates
    from rlflow.env.rewrite_env import RewriteEnv

    obs, _ = RewriteEnv(tiny_model, cost_model=wm_cost_model, max_nodes=128, max_edges=256,
                        max_candidates=64).reset()
    rules = np.asarray(obs["cand_rule"])[np.asarray(obs["cand_mask"]).astype(bool)]
    counts = np.bincount(rules)
    rule = int(np.argmax(counts))
    assert counts[rule] >= 3, "resnet-18-tiny should have a rule with several matches"
    return obs, rule, rule_candidates(obs, rule)


def _match(obs, candidate: int) -> list[int]:
    return [int(n) for n in np.asarray(obs["cand_nodes"])[candidate] if n >= 0]


def _trained_scorer(obs, rule, candidates, good: int):
    """A scorer trained on transitions where `good` pays +20 and the rule's other matches -20."""
    from rlflow.train.worldmodel.replay import Episode, Replay
    from rlflow.worldmodel.location import LocationScorer, train_location

    torch.manual_seed(0)
    replay = Replay(n_rules=int(np.max(obs["cand_rule"])) + 1)
    state = replay.add_state(obs, np.zeros(replay.n_rules, bool))
    episodes = [Episode(model="m", states=[state, state], actions=[rule], rewards=[20.0 if c == good else -20.0],
                        locations=[_match(obs, c)]) for c in candidates]
    scorer = LocationScorer(replay.n_rules, hidden=32, rounds=2)
    opt = torch.optim.Adam(scorer.parameters(), lr=3e-3)
    stats = train_location(scorer, opt, replay, episodes, epochs=150, batch=64, reward_scale=10.0,
                           rng=np.random.default_rng(0))
    assert stats["transitions"] == len(candidates)
    return scorer, replay, episodes


def test_the_scorer_learns_which_match_pays_and_the_choice_follows_it(graph_with_a_repeated_rule):
    from rlflow.worldmodel.location import choose_location, location_quality

    obs, rule, candidates = graph_with_a_repeated_rule
    good = int(candidates[-1])  # not the first listed: the old heuristic would never take it
    scorer, replay, episodes = _trained_scorer(obs, rule, candidates, good)
    rng = np.random.default_rng(0)
    assert choose_location(obs, rule, scorer, rng, explore=False) == good
    quality = location_quality(scorer, replay, episodes, reward_scale=10.0)
    assert quality["location_transitions"] == len(candidates) and quality["location_pearson"] > 0.9
    # exploring, or before any scorer is trained, every match gets tried
    assert {choose_location(obs, rule, scorer, rng, explore=True) for _ in range(200)} == set(candidates.tolist())
    assert {choose_location(obs, rule, None, rng, explore=False) for _ in range(200)} == set(candidates.tolist())
    with pytest.raises(ValueError, match="no listed candidate"):
        choose_location(obs, int(np.max(obs["cand_rule"])) + 5, scorer, rng, explore=False)


def test_the_world_model_actor_plays_the_best_scored_match(graph_with_a_repeated_rule):
    """The actor's logit of a rule's best-scored match is the rule's logit; its other matches fall below it; without
    a scorer (checkpoints from before it) every match carries the rule's logit."""
    from rlflow.agents.actor import WorldModelActor
    from rlflow.agents.worldmodel_agent import Agent
    from rlflow.rewrites import RULES
    from rlflow.train.worldmodel.config import Config

    obs, rule, candidates = graph_with_a_repeated_rule
    good = int(candidates[1])
    scorer, _, _ = _trained_scorer(obs, rule, candidates, good)
    config = Config(hidden=32, rounds=2)
    agent = Agent(config, len(RULES))
    agent.location = scorer
    actor = WorldModelActor(agent)
    logits, per_rule = actor.logits(obs), actor.rule_logits(obs)
    assert float(logits[good]) == pytest.approx(float(per_rule[rule]))
    assert all(float(logits[c]) < float(per_rule[rule]) for c in candidates if c != good)

    plain = WorldModelActor(Agent(Config(hidden=32, rounds=2, learn_location=False), len(RULES)))
    logits, per_rule = plain.logits(obs), plain.rule_logits(obs)
    assert all(float(logits[c]) == float(per_rule[rule]) for c in candidates)


def test_best_returns_follow_the_best_continuation_seen_and_stop_at_nothing():
    """Value iteration over the states of real episodes: from state 0, one episode earns 1 then 5 (via state 1),
    another 2 and stops (via state 3); a rule and its inverse between 1 and 4 (-3, +3) must not loop into a gain."""
    from rlflow.train.worldmodel.replay import Episode
    from rlflow.worldmodel.location import best_returns, location_transitions

    rule = 0
    episodes = [Episode(model="m", states=[0, 1, 2], actions=[rule, rule], rewards=[1.0, 5.0], locations=[[1], [2]]),
                Episode(model="m", states=[0, 3, 3], actions=[rule, 9], rewards=[2.0, 0.0], locations=[[3], []]),
                Episode(model="m", states=[1, 4, 1], actions=[rule, rule], rewards=[-3.0, 3.0], locations=[[4], [5]]),
                Episode(model="m", states=[2, 5], actions=[rule], rewards=[-1.0], locations=[[6]])]
    values = best_returns(episodes, n_rules=9, gamma=1.0)
    assert values[0] == pytest.approx(6.0) and values[1] == pytest.approx(5.0)
    assert values[4] == pytest.approx(8.0) and values[2] == 0.0  # state 2's only move loses: stopping is better
    assert best_returns(episodes, n_rules=9, gamma=0.5)[0] == pytest.approx(3.5)  # 1 + 0.5 * 5 against 2
    targets = {(s, tuple(nodes)): target for s, _, nodes, target in location_transitions(episodes, 9, gamma=1.0)}
    assert targets[(0, (1,))] == pytest.approx(6.0) and targets[(0, (3,))] == pytest.approx(2.0)
    assert targets[(1, (4,))] == pytest.approx(5.0)  # -3 now, then the +3 back and the 5 from state 1
    plain = {(s, tuple(nodes)): target for s, _, nodes, target in location_transitions(episodes, 9)}
    assert plain[(0, (1,))] == 1.0 and plain[(1, (4,))] == -3.0  # gamma 0: the reward alone


def test_m_reads_the_scorers_description_of_random_matches_and_zeros_elsewhere(graph_with_a_repeated_rule):
    """`match_descriptors` gives, for each step that went to a random match, the scorer's rating of that match (then
    its node embedding), the same as describing the match from the live observation (`describe_match`, which real
    rollouts use); the agent's own steps read zeros; `sequences` puts the bit before them."""
    from rlflow.train.worldmodel.replay import Episode, sequences
    from rlflow.worldmodel.location import describe_match, match_descriptors, match_width, score_transitions

    obs, rule, candidates = graph_with_a_repeated_rule
    good = int(candidates[-1])
    scorer, replay, episodes = _trained_scorer(obs, rule, candidates, good)
    for e in episodes:
        e.random_locations = [True]
    own = Episode(model="m", states=list(episodes[0].states), actions=[rule], rewards=[20.0],
                  locations=[_match(obs, good)], random_locations=[False])
    width = match_width("embedding", scorer.hidden)
    described = match_descriptors(scorer, replay, episodes + [own], width)
    assert width == 1 + scorer.hidden and torch.equal(described[id(own)], torch.zeros(1, width))
    ratings = torch.stack([described[id(e)][0, 0] for e in episodes])
    rows = [(e.states[0], e.actions[0], e.locations[0], 0.0) for e in episodes]
    assert torch.allclose(ratings, score_transitions(scorer, replay, rows), atol=1e-5)
    best = [c for c, e in zip(candidates, episodes) if e.rewards[0] > 0]
    assert int(candidates[int(torch.argmax(ratings))]) == good and best == [good]
    live = describe_match(scorer, obs, rule, _match(obs, good), width)
    assert torch.allclose(live, described[id(episodes[-1])][0], atol=1e-4)
    assert match_width("score", scorer.hidden) == 1 and match_width("none", scorer.hidden) == 0
    n = replay.n_rules
    seq = sequences(episodes + [own], torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, n, dtype=torch.bool),
                    terminate=n, sample=False, reward_scale=10.0, descriptors=described)
    assert seq["flags"].shape == (2, len(episodes) + 1, 1 + width)
    assert seq["flags"][0, :-1, 0].eq(1).all() and seq["flags"][0, -1].eq(0).all()
    assert torch.equal(seq["flags"][0, 0, 1:], described[id(episodes[0])][0])
