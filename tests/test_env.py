"""The rewrite environment: Gymnasium conformance, masks, episode ends, rewards and caps."""
from __future__ import annotations

import gymnasium
import numpy as np
import onnx
import pytest
from gymnasium.utils.env_checker import check_env
from onnx import TensorProto, helper, numpy_helper

from rlflow.env.rewrite_env import RewriteEnv
from rlflow.errors import InputError
from rlflow.rewrites import RULES


def _register() -> None:
    """What `import rlflow` does (guarded), so these tests do not depend on the package's __init__."""
    if "rlflow/Rewrite-v0" not in gymnasium.registry:
        gymnasium.register(id="rlflow/Rewrite-v0", entry_point="rlflow.env.rewrite_env:RewriteEnv")


def two_branch_model() -> onnx.ModelProto:
    """x -> Transpose -> Transpose -> two sibling MatMuls -> Relu -> Add: two rewrites apply (transpose pair,
    sibling MatMul merge)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W2")
    nodes = [
        helper.make_node("Transpose", ["x"], ["t1"], perm=[1, 0], name="t1"),
        helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0], name="t2"),
        helper.make_node("MatMul", ["t2", "W1"], ["a"], name="mm1"),
        helper.make_node("MatMul", ["t2", "W2"], ["b"], name="mm2"),
        helper.make_node("Relu", ["a"], ["ra"], name="relu1"),
        helper.make_node("Relu", ["b"], ["rb"], name="relu2"),
        helper.make_node("Add", ["ra", "rb"], ["y"], name="add"),
    ]
    graph = helper.make_graph(nodes, "two-branch", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 16])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("env") / "two-branch.onnx"
    onnx.save(two_branch_model(), str(path))
    return str(path)


@pytest.fixture(scope="module")
def cost_model(tmp_path_factory):
    from rlflow.measure.costmodel.model import CostModel

    return CostModel(cache_dir=tmp_path_factory.mktemp("costmodel"))


def node_count_ms(graph) -> float:
    """A deterministic reward source: one 'millisecond' per node."""
    return float(len(graph))


def small_env(model_path, cost_model, **kwargs) -> RewriteEnv:
    kwargs.setdefault("max_nodes", 32)
    kwargs.setdefault("max_edges", 64)
    kwargs.setdefault("max_candidates", 8)
    return RewriteEnv(model_path, cost_model=cost_model, **kwargs)


def test_check_env_passes(model_path, cost_model):
    env = small_env(model_path, cost_model)
    check_env(env, skip_render_check=True)  # rendering: test_render_ansi
    for section in ("## Description", "## Action Space", "## Observation Space", "## Rewards", "## Episode End",
                    "## Version History"):
        assert section in RewriteEnv.__doc__


def test_make_after_import_with_defaults(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    _register()
    env = gymnasium.make("rlflow/Rewrite-v0", model=model_path)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert env.action_space.n == 257 and info["action_mask"].dtype == np.int8


def test_model_is_required():
    with pytest.raises(InputError, match="needs a model"):
        RewriteEnv()


def test_action_mask_marks_candidates_and_terminate(model_path, cost_model):
    env = small_env(model_path, cost_model)
    obs, info = env.reset(seed=0)
    mask = info["action_mask"]
    assert mask.dtype == np.int8 and mask.shape == (env.action_space.n,)
    assert sorted(m.rule for m in env.candidates) == ["matmul-merge-siblings", "transpose-transpose"]
    assert mask.tolist() == [1, 1] + [0] * 6 + [1]
    assert obs["cand_mask"].tolist() == mask[:-1].tolist()
    # each candidate's rule id and root node row
    for c, match in enumerate(env.candidates):
        assert RULES[obs["cand_rule"][c]].name == match.rule
        assert obs["cand_nodes"][c, 0] == [n.name for n in env.graph.gs.nodes].index(match.root)


def test_invalid_action_is_penalised_and_changes_nothing(model_path, cost_model):
    env = small_env(model_path, cost_model, invalid_penalty=-2.5)
    env.reset(seed=0)
    before = env.graph.fingerprint()
    _, reward, terminated, truncated, info = env.step(5)  # masked: only 0, 1 and 8 are valid
    assert reward == -2.5 and info["invalid_action"] and not terminated and not truncated
    assert env.graph.fingerprint() == before and info["episode_steps"] == 1


def test_terminate_ends_the_episode(model_path, cost_model):
    env = small_env(model_path, cost_model)
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = env.step(env.terminate_action)
    assert terminated and not truncated and reward == 0.0


def test_truncation_at_max_episode_steps(model_path, cost_model):
    env = small_env(model_path, cost_model, max_episode_steps=3)
    env.reset(seed=0)
    flags = [env.step(7)[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]


def test_reward_is_relative_improvement_of_the_reward_source(model_path, cost_model):
    env = small_env(model_path, cost_model, reward=node_count_ms)
    _, info = env.reset(seed=0)
    initial = previous = float(len(env.graph))
    assert info["initial_runtime"] == initial
    total = 0.0
    done = False
    while not done:
        _, reward, terminated, truncated, info = env.step(0)
        new = float(len(env.graph))
        assert reward == pytest.approx(100.0 * (previous - new) / initial)
        previous, total, done = new, total + reward, terminated or truncated
    assert total == pytest.approx(100.0 * (initial - previous) / initial)
    assert info["real_steps"] == info["episode_steps"] and info["cost_evaluations"] == info["episode_steps"] + 1


def test_episode_ends_when_no_candidate_is_left(model_path, cost_model):
    env = small_env(model_path, cost_model, max_episode_steps=50)
    env.reset(seed=0)
    terminated = truncated = False
    steps = 0
    while not (terminated or truncated):
        _, _, terminated, truncated, info = env.step(0)
        steps += 1
    assert terminated and not truncated and steps < 50
    assert info["action_mask"].tolist() == [0] * 8 + [1]


def test_measure_source_measures_every_k_steps_and_caches_by_fingerprint(model_path, cost_model):
    env = small_env(model_path, cost_model, reward="measure", measure_every=2, measure_repeats=3)
    _, info = env.reset(seed=0)
    assert info["measurements"] == 1
    _, reward, *_ , info = env.step(0)
    assert reward == 0.0 and info["measurements"] == 1  # step 1: not measured
    env.step(env.terminate_action)  # the end is always measured
    measured = env.measurements
    assert measured == 2
    env.reset()
    env.step(0)
    env.step(env.terminate_action)
    assert env.measurements == measured  # same graphs: the fingerprint cache answers


def test_models_are_taken_in_turn_and_a_seed_restarts(model_path, cost_model, tmp_path):
    other = tmp_path / "other.onnx"
    onnx.save(two_branch_model(), str(other))
    env = small_env([model_path, str(other)], cost_model)
    names = [env.reset(seed=0)[1]["model"], env.reset()[1]["model"], env.reset()[1]["model"]]
    assert names == ["two-branch", "other", "two-branch"]
    assert env.reset(seed=1)[1]["model"] == "two-branch"
    assert env.reset(options={"model": 1})[1]["model"] == "other"


def test_caps_on_candidates_and_nodes(model_path, cost_model):
    env = small_env(model_path, cost_model, max_candidates=1, max_nodes=2)
    obs, info = env.reset(seed=0)
    assert len(env.candidates) == 1 and info["n_matches"] == 2 and info["action_mask"].tolist() == [1, 1]
    assert obs["node_mask"].tolist() == [1, 1]
    assert env.observation_space.contains(obs)
    assert env.candidates[0].rule == "transpose-transpose" and obs["cand_nodes"][0, 0] == 1  # t2 is row 1
    # a candidate whose root is past the node cap points at -1
    env2 = small_env(model_path, cost_model, max_nodes=2, rules=[r for r in RULES if r.name == "matmul-merge-siblings"])
    obs, _ = env2.reset(seed=0)
    assert obs["cand_nodes"][0, 0] == -1
    assert RULES[obs["cand_rule"][0]].name == "matmul-merge-siblings"  # ids are registry indices


def test_render_ansi(model_path, cost_model):
    env = small_env(model_path, cost_model, render_mode="ansi")
    env.reset(seed=0)
    env.step(0)
    assert "two-branch: step 1/50" in env.render()


def repeated_layers_model() -> onnx.ModelProto:
    """Two identical branches x -> Transpose -> Transpose -> Relu, added: the transpose pair matches twice."""
    nodes = []
    for b in ("a", "b"):
        nodes += [helper.make_node("Transpose", ["x"], [f"{b}1"], perm=[1, 0], name=f"{b}_t1"),
                  helper.make_node("Transpose", [f"{b}1"], [f"{b}2"], perm=[1, 0], name=f"{b}_t2"),
                  helper.make_node("Relu", [f"{b}2"], [f"{b}3"], name=f"{b}_relu")]
    nodes.append(helper.make_node("Add", ["a3", "b3"], ["y"], name="add"))
    graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_rule_scope_applies_the_chosen_rule_everywhere_it_matches(tmp_path, cost_model):
    path = tmp_path / "layers.onnx"
    onnx.save(repeated_layers_model(), str(path))
    one = small_env(str(path), cost_model, reward=node_count_ms)
    one.reset(seed=0)
    rule = one.candidates[0].rule
    assert sum(m.rule == rule for m in one.candidates) == 2
    everywhere = small_env(str(path), cost_model, reward=node_count_ms, scope="rule")
    everywhere.reset(seed=0)
    chosen = everywhere.candidates[1] if everywhere.candidates[1].rule == rule else everywhere.candidates[0]
    _, reward, _, _, info = everywhere.step(everywhere.candidates.index(chosen))
    assert len(info["applied"]) == 2 and info["applied"][0] == str(chosen)  # the chosen match first
    assert not any(m.rule == rule for m in everywhere.candidates)
    while any(m.rule == rule for m in one.candidates):  # the same graph, one match at a time
        one.step(next(i for i, m in enumerate(one.candidates) if m.rule == rule))
    assert one.fingerprint == everywhere.fingerprint and reward == pytest.approx(100.0 * 4 / 7)


def test_rule_scope_builds_a_rule_wide_rewrite_once_for_all_its_locations(tmp_path, cost_model, monkeypatch):
    """Peeking at the second location of a rule (a rollout refusing a rule that leads back) reuses the first's
    rewrite, with the second location listed first, as a step from it would apply."""
    path = tmp_path / "layers.onnx"
    onnx.save(repeated_layers_model(), str(path))
    env = small_env(str(path), cost_model, reward=node_count_ms, scope="rule")
    env.reset(seed=0)
    rule = env.candidates[0].rule
    first, second = (i for i, m in enumerate(env.candidates) if m.rule == rule)
    built = []
    rewrite = env._rewrite
    monkeypatch.setattr(env, "_rewrite", lambda graph, match: built.append(match) or rewrite(graph, match))
    chosen = env.candidates[second]
    assert env.peek(first) == env.peek(second)
    assert built == [env.candidates[first]]
    _, _, _, _, info = env.step(second)
    assert info["applied"] == [str(chosen), str(built[0])] and len(built) == 1


def _walk(env, actions: list[int]) -> list[dict]:
    """Observations along `actions` from a seeded reset (terminate -> reset)."""
    observations = [env.reset(seed=0)[0]]
    for action in actions:
        obs, _, terminated, truncated, _ = env.step(action)
        observations.append(env.reset()[0] if terminated or truncated else obs)
    return observations


def test_state_cache_counts_rewritten_weights_once_and_keeps_to_its_memory_budget(model_path, cost_model):
    from rlflow.env.graph_states import state_bytes

    env = small_env(model_path, cost_model, max_episode_steps=3)
    env.reset(seed=0)
    merge = next(i for i, m in enumerate(env.candidates) if m.rule == "matmul-merge-siblings")
    env.step(merge)
    _, made = state_bytes(env._state, env._model_weights)
    assert sorted(made.values()) == [2 * 8, 16 * 32 * 4]  # the split sizes and merged weight; W1, W2 are the model's
    actions = [merge, 0, 0, 0, 1, 0, 0, 1, 1, 0] * 3
    unbounded = _walk(env, actions)
    assert len(env._states) > 2
    one_state = sum(s.nbytes for s in env._states.values()) // len(env._states)
    bounded = small_env(model_path, cost_model, max_episode_steps=3, cache_bytes=2 * one_state)
    for expected, obs in zip(unbounded, _walk(bounded, actions)):
        assert all(np.array_equal(expected[key], obs[key]) for key in expected)  # evicted states are rebuilt alike
        assert bounded._cached_bytes <= bounded.cache_bytes or len(bounded._states) == 1
    assert len(bounded._states) <= 2 < len(env._states)
    for cache in (env, bounded):  # the running count is what the cached states hold now
        weights = {k: v for s in cache._states.values() for k, v in state_bytes(s, cache._model_weights)[1].items()}
        assert cache._cached_bytes == sum(s.nbytes for s in cache._states.values()) + sum(weights.values())


def test_a_candidate_dropped_from_an_evicted_state_stays_dropped(model_path, cost_model, monkeypatch):
    env = small_env(model_path, cost_model, cache_bytes=1)  # only the newest state is kept
    env.reset(seed=0)
    start, faulty = env.fingerprint, env.candidates[0]
    rewrite = env._rewrite

    def refuse(graph, match):
        if match == faulty:
            raise RuntimeError("a faulty rule")
        return rewrite(graph, match)

    monkeypatch.setattr(env, "_rewrite", refuse)
    assert "faulty" in env.step(0)[4]["failed"] and faulty not in env.candidates
    env.step(0)  # another state: the start is evicted
    assert start not in env._states
    env.reset(options={"model": 0})
    assert env.fingerprint == start and faulty not in env.candidates


def test_unknown_scope_is_refused(model_path, cost_model):
    with pytest.raises(ValueError, match="scope"):
        small_env(model_path, cost_model, scope="layer")
