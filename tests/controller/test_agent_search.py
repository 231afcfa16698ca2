"""The agent as a search method: rollouts never revisit a graph, estimated-faster graphs are measured first, then the
episodes' end graphs, the time limit holds, and a missing or foreign checkpoint is refused with a clear message."""
from __future__ import annotations

import time

import pytest
import torch

import rlflow
from rlflow.agents.policy import CandidatePolicy, save_checkpoint
from rlflow.errors import RlflowError
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES
from rlflow.search import agent as agent_module
from rlflow.search.agent import AgentConfig, agent_search, load_agent
from rlflow.search.candidates import distinct


@pytest.fixture
def policy():
    torch.manual_seed(0)
    return CandidatePolicy(len(RULES), hidden=16, rounds=2).eval()


def test_rollouts_never_revisit_a_graph_and_only_estimated_faster_graphs_are_measured(zoo_paths, cost_model, policy,
                                                                                       monkeypatch):
    graph = rlflow.load(zoo_paths["bert-base-tiny"])
    played, pools = [], []
    real_play, real_pool = agent_module._play, agent_module._pool

    def spy_play(env, *args, **kwargs):
        seen = []
        real_step = env.step

        def step(action):
            out = real_step(action)
            seen.append(env.fingerprint)
            return out

        env.step = step
        try:
            return real_play(env, *args, **kwargs)
        finally:
            env.step = real_step
            played.append(seen)

    def spy_pool(visited, endings, original_cost, original, top_k):
        pool = real_pool(visited, endings, original_cost, original, top_k)
        pools.append((pool, {fp: cost for fp, (cost, _) in visited.items()}, original_cost))
        return pool

    monkeypatch.setattr(agent_module, "_play", spy_play)
    monkeypatch.setattr(agent_module, "_pool", spy_pool)
    result = agent_search(graph, SessionSettings(), AgentConfig(rollouts=3, length=8, top_k=2, rounds=3,
                                                                time_limit=60, fuse_everything=False),
                          cost_model=cost_model, policy=policy)
    assert len(played) == 3
    start = graph.fingerprint()
    for fingerprints in played:  # each episode's graphs are all different, and none is the start again
        rewritten = fingerprints[:-1]  # the last step may be terminate, which keeps the graph
        assert start not in rewritten and len(set(rewritten)) == len(rewritten)
    pool, costs, original_cost = pools[-1]  # the last: what was measured (each rollout also asks, to settle)
    faster = [c.fingerprint for c in pool if costs[c.fingerprint] < original_cost]
    assert len(pool) <= 2 and [c.fingerprint for c in pool[:len(faster)]] == faster  # estimated faster first
    assert all(c.fingerprint in {f[-1] for f in played} for c in pool[len(faster):])  # then the episodes' ends
    assert result.candidates_measured <= len(pool)
    if result.applied:
        assert result.graph.fingerprint() in {c.fingerprint for c in pool}
    else:
        assert result.graph is graph


@pytest.mark.parametrize("fuse_everything", [True, False])
def test_the_fuse_everything_graph_is_measured_beside_the_rollouts(zoo_paths, cost_model, policy, monkeypatch,
                                                                   fuse_everything):
    """Second and third in the pool, which keeps its size (after the greedy episode's end, the policy's own choice),
    and named in the stop reason when it is the one kept; left out where the config says (training's evaluation
    scores the policy alone)."""
    graph = rlflow.load(zoo_paths["bert-base-tiny"])
    priors = []
    real_prior = agent_module.fuse_everything
    monkeypatch.setattr(agent_module, "fuse_everything", lambda *args: priors.append(real_prior(*args)) or priors[-1])
    rollouts = [agent_module.Candidate(graph, (), f"rollout-{i}") for i in range(3)]
    measured = []

    def select(original, pool, *args, stop_reason, **kwargs):
        measured.extend(pool)
        best = pool[1] if len(pool) > 1 else pool[0]  # as if the second were measured fastest
        return agent_module.SearchResult(best.graph, list(best.applied), len(pool), 0.0, stop_reason)

    monkeypatch.setattr(agent_module, "_pool", lambda *args: list(rollouts))
    monkeypatch.setattr(agent_module, "select_measured", select)
    config = AgentConfig(rollouts=1, length=2, top_k=3, rounds=3, time_limit=60, fuse_everything=fuse_everything)
    result = agent_search(graph, SessionSettings(), config, cost_model=cost_model, policy=policy)
    fingerprints = [c.fingerprint for c in measured]
    if fuse_everything:
        (fused,) = priors  # the fuse-everything graphs, one or two
        assert fused and fingerprints == ["rollout-0", *(f.fingerprint for f in fused), "rollout-1"][:3]
        assert "(the fuse-everything graph" in result.stop_reason and result.stop_reason.endswith(", not a rollout's)")
    else:
        assert priors == [] and fingerprints == ["rollout-0", "rollout-1", "rollout-2"]
        assert "fuse-everything" not in result.stop_reason


def test_a_graph_both_a_rollout_and_the_fuse_everything_prior_reached_is_measured_once():
    def candidate(fp, origin):
        return agent_module.Candidate(origin, (), fp)

    pool = distinct([candidate("a", "rollout"), candidate("b", "prior"), candidate("a", "prior"),
                                   candidate("c", "rollout")])
    assert [(c.fingerprint, c.graph) for c in pool] == [("a", "rollout"), ("b", "prior"), ("c", "rollout")]


def test_the_pool_takes_estimated_faster_graphs_first_then_the_episodes_ends():
    """The cost model ranks what to measure, but where it estimates fewer than `top_k` graphs faster the policy's own
    end graphs fill the pool (a table that misprices a fusion must not leave nothing to measure); the input never."""
    def candidate(fp):
        return agent_module.Candidate(None, (), fp)

    visited = {fp: (cost, candidate(fp)) for fp, cost in
               {"start": 10.0, "end-slower": 11.0, "end-faster": 9.0, "faster": 8.0, "slower": 12.0}.items()}
    endings = ["end-slower", "end-faster", "start"]
    pool = agent_module._pool(visited, endings, 10.0, "start", top_k=4)
    assert [c.fingerprint for c in pool] == ["end-faster", "faster", "end-slower"]
    assert [c.fingerprint for c in agent_module._pool(visited, endings, 10.0, "start", top_k=2)] == [
        "end-faster", "faster"]
    assert agent_module._pool(visited, ["start"], 7.0, "start", top_k=4) == []


@pytest.mark.parametrize("patience, played", [(2, 2), (0, 5)])
def test_rollouts_stop_once_they_leave_the_graphs_to_measure_unchanged(zoo_paths, cost_model, policy, monkeypatch,
                                                                       patience, played):
    """`patience` rollouts in a row that change nothing to measure end the rollouts (0: every rollout is played); a
    pool that never changes is the case where every rollout after the first is wasted time."""
    graph = rlflow.load(zoo_paths["bert-base-tiny"])
    calls = []
    real_play = agent_module._play
    monkeypatch.setattr(agent_module, "_play", lambda *args, **kwargs: calls.append(1) or real_play(*args, **kwargs))
    monkeypatch.setattr(agent_module, "_pool", lambda *args: [])
    config = AgentConfig(rollouts=5, length=3, rounds=3, time_limit=60, patience=patience)
    result = agent_search(graph, SessionSettings(), config, cost_model=cost_model, policy=policy)
    assert len(calls) == played
    assert result.stop_reason.startswith("settled: 2 rollouts in a row" if patience else "all rollouts done")


def test_time_limit_is_honoured(zoo_paths, cost_model, policy):
    graph = rlflow.load(zoo_paths["resnet-18-tiny"])
    start = time.monotonic()
    agent_search(graph, SessionSettings(), AgentConfig(rollouts=50, time_limit=4, rounds=3), cost_model=cost_model,
                 policy=policy)
    assert time.monotonic() - start < 4 + 3  # the last measurement batch may finish after the deadline


def test_load_agent_refuses_missing_and_foreign_checkpoints(tmp_path, policy, monkeypatch):
    with pytest.raises(RlflowError, match="no such checkpoint"):
        load_agent(tmp_path / "absent.pt")
    path = save_checkpoint(tmp_path / "agent.pt", policy)
    assert isinstance(load_agent(path), CandidatePolicy)
    payload = torch.load(path, weights_only=False)
    payload["registry_version"] = "0" * 12
    torch.save(payload, tmp_path / "foreign.pt")
    with pytest.raises(RlflowError, match="registry"):
        load_agent(tmp_path / "foreign.pt")
    monkeypatch.setattr(agent_module, "DEFAULT_AGENT", tmp_path / "shipped.pt")
    with pytest.raises(RlflowError, match="shipped agent"):
        load_agent()


def test_peek_does_not_move_the_environment(zoo_paths, cost_model):
    from rlflow.env.rewrite_env import RewriteEnv

    env = RewriteEnv(zoo_paths["resnet-18-tiny"], cost_model=cost_model, max_episode_steps=5)
    _, info = env.reset(seed=0)
    before = env.fingerprint
    child = env.peek(0)
    assert env.fingerprint == before and child is not None and child != before
    env.step(0)
    assert env.fingerprint == child
    assert env.peek(env.terminate_action) is None and env.peek(-1) is None


def test_the_measurement_keeps_what_screening_the_top_k_takes_up_to_a_share_of_the_limit(zoo_paths, monkeypatch):
    """Half the limit, or what one candidate takes where more (`measurement_reserve`), or what the `top_k` take as
    the probed pace predicts, up to MEASURE_SHARE of the limit."""
    from rlflow.measure.timing import Pace

    graph = rlflow.load(zoo_paths["bert-base-tiny"])
    config = AgentConfig(time_limit=10, top_k=4)

    def share(one: float, session: float) -> float:
        pace = Pace()
        pace.seconds.update(export=0.0, session=session, run=0.0)
        monkeypatch.setattr(agent_module, "measurement_reserve", lambda *args: one)
        return agent_module._measurement_share(graph, SessionSettings(), config, pace)

    assert share(1.0, 0.01) == 5.0  # a small model: half the limit
    assert share(6.0, 0.01) == 6.0  # one candidate takes more
    top = agent_module.RESERVE_SLACK * 5 * 1.0  # five sessions of a second (the input and four candidates)
    assert share(1.0, 1.0) == pytest.approx(min(top, 7.0))
    assert share(1.0, 10.0) == pytest.approx(agent_module.MEASURE_SHARE * 10)  # the rollouts keep the rest


def test_without_time_to_screen_the_input_is_kept_and_the_reason_says_what_limit_would_do(zoo_paths, cost_model,
                                                                                           policy, monkeypatch):
    graph = rlflow.load(zoo_paths["bert-base-tiny"])
    offered = []

    def every_visited(visited, endings, original_cost, original, top_k):
        best = [candidate for _, candidate in sorted(visited.values(), key=lambda pair: pair[0])[:2]]
        offered.extend(c for c in best if all(c.fingerprint != o.fingerprint for o in offered))  # a graph once
        return list(offered)

    monkeypatch.setattr(agent_module, "_pool", every_visited)
    monkeypatch.setattr(agent_module, "affordable", lambda *args: 0)
    result = agent_search(graph, SessionSettings(), AgentConfig(rollouts=2, length=4, time_limit=60,
                                                                fuse_everything=False),  # the pool is `offered`
                          cost_model=cost_model, policy=policy)
    assert offered, "the rollouts reached no graph: the test would not test anything"
    assert result.candidates_measured == 0 and result.applied == []
    assert result.graph.fingerprint() == graph.fingerprint()
    assert "no time left to measure a candidate" in result.stop_reason
    assert f"would measure {len(offered)})" in result.stop_reason and result.candidates_unmeasured == len(offered)


def test_a_model_whose_measurement_takes_the_whole_limit_plays_no_rollout(zoo_paths, cost_model, policy, monkeypatch):
    """The input is probed first: where measuring one candidate against it would take the limit, the agent is not
    even loaded, the input is kept, and the reason says what limit would do."""
    graph = rlflow.load(zoo_paths["bert-base-tiny"])
    monkeypatch.setattr(agent_module, "measurement_reserve", lambda *args: 12.0)
    monkeypatch.setattr(agent_module, "_play", lambda *args, **kwargs: pytest.fail("no rollout fits"))
    monkeypatch.setattr(agent_module, "load_agent", lambda *args: pytest.fail("nothing to load the agent for"))
    result = agent_search(graph, SessionSettings(), AgentConfig(time_limit=10), cost_model=cost_model)
    assert result.graph is graph and result.applied == [] and result.candidates_measured == 0
    assert result.stop_reason.startswith("no time for rollouts: measuring one candidate against the input takes "
                                         "about 12 s")
    assert "a time limit of about 24 s" in result.stop_reason


def test_the_agent_plays_the_scope_its_checkpoint_was_trained_in(tmp_path, zoo_paths, cost_model, policy, monkeypatch):
    path = save_checkpoint(tmp_path / "rule.pt", policy, config={"scope": "rule", "max_episode_steps": 2})
    loaded = load_agent(path)
    assert loaded.config["scope"] == "rule" and load_agent(save_checkpoint(tmp_path / "old.pt", policy)).config == {}
    scopes = []
    real_play = agent_module._play

    def spy_play(env, *args, **kwargs):
        scopes.append((env.scope, env.max_episode_steps))
        return real_play(env, *args, **kwargs)

    monkeypatch.setattr(agent_module, "_play", spy_play)
    agent_search(rlflow.load(zoo_paths["bert-base-tiny"]), SessionSettings(),
                 AgentConfig(rollouts=1, length=3, top_k=1, rounds=3, time_limit=30), cost_model=cost_model,
                 policy=loaded)
    assert scopes == [("rule", 2)]  # the scope and the episode length it was trained with


def test_an_agent_from_a_registry_this_one_extends_acts_on_the_rules_it_knows(zoo_paths, cost_model, monkeypatch):
    """RULES is append-only: after a rule is added, the shipped agents (trained before it) still load, and their
    environment offers only the rules they were trained on; a registry that is not an extension is still refused.
    (A fusion appended to the registry reaches them through the fuse-everything graphs, which take every rule
    offered: this one has no group, so it is in none.)"""
    import rlflow.env.rewrite_env
    import rlflow.rewrites
    from rlflow.rewrites import rule
    from rlflow.rewrites.base import registry_version
    from rlflow.search.agent import known_rules

    base = type(rule("attention-fusion"))
    extra = type("ExtraAttentionFusion", (base,), {"name": "extra-attention-fusion", "__doc__": base.__doc__})()
    extended = (*RULES, extra)
    for module in (rlflow.rewrites, rlflow.env.rewrite_env, agent_module):
        monkeypatch.setattr(module, "RULES", extended)
    monkeypatch.setattr(rlflow.rewrites, "REGISTRY_VERSION", registry_version(extended))

    shipped = load_agent()  # trained on RULES before `extra`: taken, where any other registry change refuses it
    trained = list(RULES[:shipped.n_rules])  # the registry it was trained on: RULES then, or a prefix of it now
    assert known_rules(shipped, extended) == trained
    offered = []

    class Recording(rlflow.env.rewrite_env.RewriteEnv):
        def __init__(self, *args, rules=(), **kwargs):
            offered.append([r.name for r in rules])
            super().__init__(*args, rules=rules, **kwargs)

    monkeypatch.setattr(rlflow.env.rewrite_env, "RewriteEnv", Recording)
    graph = rlflow.load(zoo_paths["bert-base-tiny"])
    assert extra.find(graph)  # the new rule matches here, so only the restriction keeps it from the agent
    result = agent_search(graph, SessionSettings(), AgentConfig(rollouts=2, time_limit=6, rounds=3), extended,
                          cost_model=cost_model, policy=shipped)
    assert offered and all("extra-attention-fusion" not in names for names in offered)
    assert all(m.rule != "extra-attention-fusion" for m in result.applied)

    import types

    import rlflow.train.finetune as finetune_module
    from rlflow.optimize.pipeline import _finetuned

    adapted = []

    def adapt(agent, graph, steps, *, rules, **kwargs):  # what --finetune would train on
        adapted.append([r.name for r in rules])
        return agent, types.SimpleNamespace(steps=0, updates=0, seconds=0.0, stop_reason="stub")

    monkeypatch.setattr(finetune_module, "finetune_in_dream", adapt)
    _finetuned(graph, SessionSettings(), None, 1, 0, extended, deadline=None)
    assert adapted == [[r.name for r in trained]]

    monkeypatch.setattr(rlflow.rewrites, "RULES", (extra, *RULES))  # not an extension: the ids would move
    monkeypatch.setattr(rlflow.rewrites, "REGISTRY_VERSION", registry_version((extra, *RULES)))
    with pytest.raises(RlflowError, match="registry"):
        load_agent()
