"""The world-model loop end to end on one tiny model, checkpoints, and the dream controller."""
from __future__ import annotations

import json

import pytest
import torch

from rlflow.errors import RlflowError


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    from rlflow.train.worldmodel.loop import Config, main

    out = tmp_path_factory.mktemp("wm")
    config = Config(models=(tiny_model,), iterations=2, random_steps=40, collect_steps=20, vae_epochs=2,
                    mdrnn_epochs=3, dream_steps=512, dream_envs=16, dream_rollout=16, max_nodes=128,
                    max_edges=256, max_candidates=64, out=str(out / "results"), run_dir=str(out / "run"),
                    ppo_results=str(out / "missing.json"), cost_cache=str(out / "costmodel"))
    return config, main(config)


def test_one_training_run_end_to_end(run):
    from pathlib import Path

    config, result = run
    for key in ("reward_pearson", "mask_accuracy", "real_steps_worldmodel", "real_steps_ppo",
                "final_reward_worldmodel", "final_reward_ppo"):
        assert key in result
    assert result["real_steps_worldmodel"] >= 60 and result["real_steps_ppo"] is None
    assert len(result["curve"]) == 2 and result["curve"][-1]["real_steps"] == result["real_steps_worldmodel"]
    assert "best return" in result["definitions"]["location_pearson"]  # the scorer's target with location_gamma
    by_source = result["quality"]["reward_pearson_by_source"]  # held-out episodes: random walks, collection, greedy
    assert by_source and set(by_source) <= {"random", "controller", "eval"}
    out = Path(config.out)
    assert json.loads((out / "worldmodel.json").read_text())["algo"] == "worldmodel"
    assert (out / "worldmodel-quality.png").stat().st_size > 0 and (out / "sample-efficiency.png").stat().st_size > 0


def test_checkpoint_round_trip_resume_and_registry_refusal(run, tmp_path):
    import dataclasses
    from pathlib import Path

    from rlflow.agents.worldmodel_agent import Agent, load_checkpoint, save_checkpoint
    from rlflow.train.worldmodel.loop import main

    config, result = run
    path = Path(config.run_dir) / "worldmodel.pt"
    agent, payload = load_checkpoint(path)
    assert payload["iteration"] == 1 and payload["real_steps"] == result["real_steps_worldmodel"]
    assert payload["agent"]["vision_opt"]["state"] and payload["replay"]["episodes"]
    # random walks mark a step random-located only where its rule had a choice of matches: both kinds occur
    walked = [(a, at_random) for e in payload["replay"]["episodes"] if e["source"] == "random"
              for a, at_random in zip(e["actions"], e["random_locations"]) if a < agent.n_rules]
    assert {at_random for _, at_random in walked} == {True, False}
    again = tmp_path / "again.pt"
    save_checkpoint(again, agent, config)
    reloaded, _ = load_checkpoint(again)
    assert agent.location is not None and agent.mdrnn.location_flag
    for name in ("vision", "mdrnn", "policy", "location"):
        for (k, a), (_, b) in zip(getattr(agent, name).state_dict().items(),
                                  getattr(reloaded, name).state_dict().items()):
            assert torch.equal(a, b), k
    # an agent that only acts (the agent search's) loads the same networks without optimisers (building them imports
    # torch._dynamo: seconds of a search's limit)
    acting, _ = load_checkpoint(again, optimisers=False)
    assert all(getattr(acting, f"{name}_opt") is None for name in ("vision", "mdrnn", "policy", "location"))
    for name in ("vision", "mdrnn", "policy", "location"):
        for (k, a), (_, b) in zip(getattr(agent, name).state_dict().items(),
                                  getattr(acting, name).state_dict().items()):
            assert torch.equal(a, b), k
    with pytest.raises(RlflowError, match="rule registry"):
        load_checkpoint(again, registry_version="not-this-one")
    # a checkpoint from before the location scorer (no learn_location in its config) loads as it was trained: no
    # scorer, no random-location bit, rules at their first listed match
    old = torch.load(again, weights_only=False)
    del old["config"]["learn_location"]
    old["agent"] = Agent(dataclasses.replace(config, learn_location=False), agent.n_rules).state_dict()
    torch.save(old, tmp_path / "old.pt")
    before, _ = load_checkpoint(tmp_path / "old.pt")
    assert before.location is None and not before.mdrnn.location_flag
    # one from before match_input (M read no description of a random match) loads as it was trained too
    old = torch.load(again, weights_only=False)
    del old["config"]["match_input"]
    old["agent"] = Agent(dataclasses.replace(config, match_input="none"), agent.n_rules).state_dict()
    torch.save(old, tmp_path / "old.pt")
    before, _ = load_checkpoint(tmp_path / "old.pt")
    assert before.location is not None and before.mdrnn.match_features == 0
    # one from before reward_symlog (M's heads learnt the rewards as they are) reads its heads as rewards
    assert config.reward_symlog > 0
    assert agent.mdrnn.reward_knee == pytest.approx(config.reward_symlog / config.reward_scale)
    old = torch.load(again, weights_only=False)
    del old["config"]["reward_symlog"]
    old["agent"] = Agent(dataclasses.replace(config, reward_symlog=0.0), agent.n_rules).state_dict()
    torch.save(old, tmp_path / "old.pt")
    before, _ = load_checkpoint(tmp_path / "old.pt")
    assert before.mdrnn.reward_knee == 0.0
    with pytest.raises(RlflowError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    # resuming a finished run trains no more iterations and keeps its figures
    resumed = main(dataclasses.replace(config, resume=True, report=False))
    assert resumed["real_steps_worldmodel"] == result["real_steps_worldmodel"]


def test_dream_returns_are_uncapped_unless_asked(run):
    """By default a dream episode may earn more than the real episodes from its start did (capped, the controller
    gained nothing by taking the best rewrite first); `cap_returns` gives every start its cap, never negative."""
    import dataclasses
    from pathlib import Path

    from rlflow.train.worldmodel.learn import make_dream
    from rlflow.train.worldmodel.rerun_quality import checkpoint_inputs

    config, _ = run
    agent, _, replay, mu, logvar, descriptors = checkpoint_inputs(Path(config.run_dir) / "worldmodel.pt")
    episodes = replay.split(False)
    uncapped = make_dream(agent, episodes, mu, logvar, config, seed=0, descriptors=descriptors)
    capped = make_dream(agent, episodes, mu, logvar, dataclasses.replace(config, cap_returns=True), seed=0,
                        descriptors=descriptors)
    assert uncapped.start_caps is None
    assert capped.start_caps is not None and len(capped.start_caps) == len(capped.start_weights)
    assert (capped.start_caps >= 0).all() and torch.isfinite(capped.start_caps).all()


def test_quality_recomputed_from_the_checkpoint_is_the_reported_one(run):
    """The checkpoint holds what the last quality figures were computed from (less the last greedy evaluation's
    episodes): benchmarks/agent-deploy/requality.py rests on it.  The moved-only Spearman counts its transitions."""
    from pathlib import Path

    from rlflow.train.worldmodel.rerun_quality import checkpoint_quality

    config, _ = run
    again, reported = checkpoint_quality(Path(config.run_dir) / "worldmodel.pt")
    for key in ("reward_pearson", "reward_spearman", "reward_mse", "moved_transitions", "zero_transitions"):
        assert again[key] == pytest.approx(reported[key], nan_ok=True), key
    assert 0 <= reported["zero_transitions"] <= reported["heldout_transitions"] - reported["moved_transitions"]


def test_quality_report_has_a_rank_correlation_that_ties_share():
    import numpy as np

    from rlflow.measure.ranks import pearson, rankdata, spearman

    assert rankdata([3.0, 1.0, 1.0, 2.0]).tolist() == [4.0, 1.5, 1.5, 3.0]
    real = np.array([-600.0, -1.0, 0.0, 0.5, 1.0])
    predicted = np.array([-5.0, -0.5, 0.1, 0.2, 0.9])  # the order right, the outlier's size far off
    assert spearman(predicted, real) == pytest.approx(1.0) and pearson(predicted, real) < 0.99
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)


def test_controller_learns_in_a_dream_with_a_known_best_rule():
    """In a dream whose reward model pays +1 for rule 1 and -1 otherwise, PPO learns to prefer rule 1."""
    from rlflow.agents.controller import LatentPolicy
    from rlflow.train.worldmodel.dream import DreamBatch
    from rlflow.train.worldmodel.dream_ppo import DreamPPOConfig, train_in_dream
    from rlflow.worldmodel.mdrnn import MDRNN

    torch.manual_seed(0)
    model = MDRNN(latent_size=4, n_actions=4, n_rules=3, hidden=8, gaussians=1, reward_ensemble=1)
    with torch.no_grad():
        head = model.reward_heads[0]
        for p in head.parameters():
            p.zero_()
        # reward = sum of a one-hot feature routed through the hidden layer: +1 for action 1, -1 for actions 0, 2
        first, last = head[0], head[-1]
        offset = model.hidden + model.latent_size
        first.weight[0, offset + 1] = 1.0
        first.weight[1, offset + 0] = 1.0
        first.weight[1, offset + 2] = 1.0
        last.weight[0, 0], last.weight[0, 1] = 1.0, -1.0
        model.mask_head[-1].bias.fill_(5.0)
        model.done_head[-1].bias.fill_(-5.0)
    dream = DreamBatch(model, torch.zeros(1, 4), torch.zeros(1, 4), 16, max_episode_steps=5, seed=0)
    policy = LatentPolicy(4 + 8, 4, 32)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    stats = train_in_dream(policy, opt, dream, DreamPPOConfig(total_steps=6000, num_envs=16, num_steps=16))
    dream.reset()
    with torch.no_grad():
        action, *_ = policy.get_action_and_value(dream.observation(), dream.action_mask(), greedy=True)
    assert (action == 1).float().mean() > 0.9 and stats["dream_return"] > 2.0


def test_exploration_tries_every_rule_of_a_state_before_repeating_one():
    import numpy as np

    from rlflow.train.worldmodel.episodes import explore_action

    rng = np.random.default_rng(0)
    tried: dict = {}
    rules = np.array([3, 5, 7])
    picked = []
    for _ in range(3):
        a = explore_action(rules, 0, tried, rng, 0.0, 9)
        tried[(0, a)] = tried.get((0, a), 0) + 1
        picked.append(a)
    assert sorted(picked) == [3, 5, 7]
    assert explore_action(np.array([], int), 0, tried, rng, 0.0, 9) == 9
    assert explore_action(rules, 0, tried, rng, 1.0, 9) == 9


def test_exploration_by_match_draws_rules_as_often_as_their_matches_and_still_tries_each_first():
    """With per-rule match counts a rule with 17 matches beside two of one match each is drawn about 17 times in
    19 (uniformly it would be one in three), and a state still has every rule tried before any twice."""
    import numpy as np

    from rlflow.train.worldmodel.episodes import explore_action

    rng = np.random.default_rng(0)
    rules, matches = np.array([0, 1, 2]), np.array([17, 1, 1, 0])
    draws = [explore_action(rules, 0, None, rng, 0.0, 3, matches) for _ in range(2000)]
    assert np.mean(np.array(draws) == 0) == pytest.approx(17 / 19, abs=0.03)
    tried: dict = {}
    for _ in range(3):
        a = explore_action(rules, 0, tried, rng, 0.0, 3, matches)
        tried[(0, a)] = tried.get((0, a), 0) + 1
    assert sorted(tried) == [(0, 0), (0, 1), (0, 2)]


def test_world_model_agent_ships_plays_real_candidates_and_finetunes_in_the_dream(run, tmp_path):
    """The trained world model as `rlflow optimize`'s agent: shipped without its replay, loaded by `--agent`, its
    rule choice mapped onto the real candidates, h advanced by M, and `--finetune` spent in the dream."""
    from pathlib import Path

    import numpy as np

    from rlflow.agents.actor import WorldModelActor
    from rlflow.env.observation import NEG
    from rlflow.env.rewrite_env import RewriteEnv
    from rlflow.measure.costmodel.model import CostModel
    from rlflow.optimize.pipeline import optimize
    from rlflow.optimize.report import format_report
    from rlflow.search.agent import load_agent
    from rlflow.train.ship import ship_worldmodel

    config, _ = run
    meta = ship_worldmodel(Path(config.run_dir) / "worldmodel.pt", Path(config.out) / "worldmodel.json",
                           tmp_path, "wm")
    shipped = tmp_path / "wm.pt"
    assert meta["algo"] == "worldmodel" and meta["bytes"] == shipped.stat().st_size
    assert "replay" not in torch.load(shipped, weights_only=False)
    assert "resnet-50" in meta["held_out"] and "resnet-18" not in meta["held_out"]  # trained on resnet-18-tiny's file
    assert meta["provider"] == "cpu"
    # the rules offered in training: those matching the training model's graphs, a subset of the registry
    from rlflow.graph.core import load
    from rlflow.rewrites import RULES, find_matches
    from rlflow.search.agent import offered_rules

    assert offered_rules(shipped) == meta["rules_offered"]
    assert {m.rule for m in find_matches(load(config.models[0]))} <= set(meta["rules_offered"])
    assert set(meta["rules_offered"]) < {r.name for r in RULES}
    actor = load_agent(shipped)
    assert isinstance(actor, WorldModelActor) and actor.reward_range is not None

    env = RewriteEnv(config.models[0], cost_model=CostModel(cache_dir=config.cost_cache))
    obs, _ = env.reset()
    logits = actor.logits(obs)
    rules, listed = np.asarray(obs["cand_rule"]), np.asarray(obs["cand_mask"]).astype(bool)
    per_rule = actor.rule_logits(obs)
    assert logits.shape == (len(rules) + 1,) and float(logits[-1]) == float(per_rule[-1])
    # each rule's best-scored match carries the rule's logit, its other matches no more
    for rule in np.unique(rules[listed]):
        mine = np.flatnonzero(listed & (rules == rule))
        assert max(float(logits[i]) for i in mine) == pytest.approx(float(per_rule[rule]))
        assert all(float(logits[i]) <= float(per_rule[rule]) for i in mine)
    assert (logits[:-1][torch.as_tensor(~listed)] == NEG).all()
    before = actor.state[0].clone()
    actor.observe(int(np.flatnonzero(listed)[0]), obs)
    assert not torch.equal(before, actor.state[0])
    actor.reset()
    assert torch.equal(actor.state[0], torch.zeros_like(before))

    weights = {k: v.clone() for k, v in actor.agent.policy.state_dict().items()}
    result = optimize(config.models[0], method="agent", agent=shipped, time_limit=20, finetune=2048, rounds=5)
    tuned = result.settings["finetune"]
    assert tuned["environment"] == "dream" and tuned["steps"] == 2048
    assert tuned["updates"] == 2048 // (config.dream_envs * config.dream_rollout)  # the run's dream settings
    import hashlib

    identity = result.settings["agent"]  # which checkpoint acted: its path and its bytes' hash
    assert identity == {"path": str(Path(shipped).resolve()), "sha256": hashlib.sha256(Path(shipped).read_bytes()).hexdigest()}
    assert f"SHA-256 {identity['sha256'][:12]}" in format_report(result)
    assert "2048 dream steps" in format_report(result) and result.outcome in (
        "rewritten", "gate rejected", "not verified", "out of time", "nothing found")
    assert all(torch.equal(v, load_agent(shipped).agent.policy.state_dict()[k]) for k, v in weights.items())


def test_dream_finetune_stops_at_its_deadline_and_leaves_the_agent_alone(run):
    import time
    from pathlib import Path

    from rlflow.agents.actor import load_actor
    from rlflow.measure.costmodel.model import CostModel
    from rlflow.train.finetune import finetune_in_dream

    config, _ = run
    actor, _ = load_actor(Path(config.run_dir) / "worldmodel.pt")
    weights = {k: v.clone() for k, v in actor.agent.policy.state_dict().items()}
    cost_model = CostModel(cache_dir=config.cost_cache)
    adapted, report = finetune_in_dream(actor, config.models[0], 10_000, cost_model=cost_model,
                                        deadline=time.monotonic())
    assert report.updates == 0 and report.stop_reason == "time limit" and report.environment == "dream"
    adapted, report = finetune_in_dream(actor, config.models[0], 1, cost_model=cost_model)
    assert report.updates == 1 and report.steps == config.dream_envs * config.dream_rollout
    assert any(not torch.equal(v, adapted.agent.policy.state_dict()[k]) for k, v in weights.items())
    assert all(torch.equal(v, actor.agent.policy.state_dict()[k]) for k, v in weights.items())


def test_greedy_evaluation_never_steps_back_to_a_graph_it_has_visited(tiny_model, wm_cost_model):
    """A controller that prefers a rule and its inverse above stopping steps back and forth between two graphs for
    the whole episode; with `avoid_revisits` (the evaluation's setting) it stops where its next rewrite would lead
    to a graph it has seen."""
    import numpy as np

    from rlflow.agents.worldmodel_agent import Agent
    from rlflow.env.rewrite_env import RewriteEnv
    from rlflow.rewrites import RULES
    from rlflow.train.worldmodel.config import Config
    from rlflow.train.worldmodel.episodes import real_episode
    from rlflow.train.worldmodel.replay import Replay

    names = [r.name for r in RULES] + ["terminate"]
    config = Config(hidden=16, rounds=1, learn_location=False, max_nodes=128, max_edges=256, max_candidates=64)
    agent = Agent(config, len(RULES))
    preference = torch.full((len(RULES) + 1,), -5.0)
    preference[names.index("gemm-to-matmul-add")] = preference[names.index("matmul-add-to-gemm")] = 5.0
    preference[len(RULES)] = 0.0  # terminate: below the pair, above everything else
    with torch.no_grad():
        agent.policy.actor[-1].weight.zero_()
        agent.policy.actor[-1].bias.copy_(preference)
    env = RewriteEnv(tiny_model, cost_model=wm_cost_model, max_episode_steps=8, max_nodes=128, max_edges=256,
                     max_candidates=64)
    visits: list[str] = []
    real_reset, real_step = env.reset, env.step

    def reset(**kwargs):
        out = real_reset(**kwargs)
        visits.clear()
        visits.append(env.fingerprint)
        return out

    def step(action):
        out = real_step(action)
        if action != env.terminate_action:
            visits.append(env.fingerprint)
        return out

    env.reset, env.step = reset, step
    replay, rng = Replay(len(RULES)), np.random.default_rng(0)
    looping = real_episode(env, 0, agent, replay, rng, greedy=True)
    assert [names[a] for a in looping.actions] == ["gemm-to-matmul-add", "matmul-add-to-gemm"] * 4
    assert len(set(visits)) < len(visits) and looping.truncated
    avoiding = real_episode(env, 0, agent, replay, rng, greedy=True, avoid_revisits=True)
    assert names[avoiding.actions[0]] == "gemm-to-matmul-add" and names[avoiding.actions[-1]] == "terminate"
    assert len(set(visits)) == len(visits) and len(avoiding.actions) < len(looping.actions)


def test_m_keeps_the_epoch_with_the_lowest_loss_on_its_validation_episodes(run):
    """With a validation share, M ends with the weights of its best epoch on the episodes set aside (drawn first from
    the generator): its loss there now is the best one it reports, no higher than the last epoch's."""
    import dataclasses
    from pathlib import Path

    import numpy as np

    from rlflow.agents.worldmodel_agent import load_checkpoint
    from rlflow.train.worldmodel.learn import train_mdrnn
    from rlflow.train.worldmodel.quality import encode_all
    from rlflow.train.worldmodel.replay import Replay, sequences
    from rlflow.worldmodel.mdrnn import mdrnn_loss

    config, _ = run
    agent, payload = load_checkpoint(Path(config.run_dir) / "worldmodel.pt")
    replay = Replay.from_state_dict(payload["replay"])
    episodes = replay.split(False)
    assert len(episodes) >= 10
    mu, logvar = encode_all(agent.vision, replay)
    config = dataclasses.replace(config, mdrnn_epochs=6, mdrnn_validation=0.3)
    stats = train_mdrnn(agent, replay, episodes, mu, logvar, config, np.random.default_rng(7))
    held = int(round(0.3 * len(episodes)))
    validation = [episodes[i] for i in np.random.default_rng(7).permutation(len(episodes))[:held]]
    seq = sequences(validation, mu, logvar, torch.as_tensor(np.stack(replay.rule_masks)), agent.n_rules,
                    sample=False, reward_scale=config.reward_scale)
    with torch.no_grad():
        out = agent.mdrnn(seq["actions"], seq["latents"], flags=seq["flags"])
        now = float(mdrnn_loss(out, seq["next_latents"], seq["rewards"], seq["dones"], seq["masks"], seq["valid"],
                               seq["state_valid"], config.mask_weight)["loss"])
    assert 1 <= stats["best_epoch"] <= 6
    assert now == pytest.approx(stats["best_validation_loss"], rel=1e-5)
    assert stats["best_validation_loss"] <= stats["validation_loss"] + 1e-9


def test_the_reward_error_is_shared_out_by_rule():
    import numpy as np

    from rlflow.rewrites import RULES
    from rlflow.train.worldmodel.quality import error_by_rule

    shares = error_by_rule(np.array([0.0, 0.0, 1.0, 5.0]), np.array([1.0, 1.0, 1.0, 2.0]), np.array([0, 0, 1, 2]))
    assert shares == {RULES[2].name: pytest.approx(9 / 11, abs=1e-4), RULES[0].name: pytest.approx(2 / 11, abs=1e-4),
                      RULES[1].name: 0.0}
    assert error_by_rule(np.ones(3), np.ones(3), np.zeros(3, int)) == {}


def test_reward_bootstrap_deals_each_episode_to_members_once_for_the_run():
    """Each episode goes to about `share` of the members, at least one, the same ones on every call (the draw rests
    on the episode's place in the replay, so iterations keep members apart); 0 and 1 deal everything to all."""
    from rlflow.train.worldmodel.learn import reward_bootstrap
    from rlflow.train.worldmodel.replay import Episode, Replay

    replay = Replay(3)
    replay.episodes = [Episode(model=f"m{i}") for i in range(400)]
    dealt = reward_bootstrap(replay, 5, 0.4, seed=3)
    again = reward_bootstrap(replay, 5, 0.4, seed=3)
    rows = torch.stack([dealt[id(e)] for e in replay.episodes])
    assert torch.equal(rows, torch.stack([again[id(e)] for e in replay.episodes]))
    assert bool((rows.sum(1) >= 1).all()) and 0.35 < float(rows.mean()) < 0.5
    other = reward_bootstrap(replay, 5, 0.4, seed=4)
    assert not torch.equal(rows, torch.stack([other[id(e)] for e in replay.episodes]))
    assert reward_bootstrap(replay, 5, 0.0, seed=3) == {} == reward_bootstrap(replay, 5, 1.0, seed=3)


def test_a_run_whose_world_model_reads_the_random_matches(run, tmp_path):
    """By default (match_input "embedding") M's reward reads the scorer's rating and embedding of each random match
    (1 + the scorer's width more numbers; the LSTM reads only the bit), the held-out figures count random-located
    steps, and an unknown match_input is refused."""
    import dataclasses
    from pathlib import Path

    from rlflow.agents.worldmodel_agent import load_checkpoint
    from rlflow.train.worldmodel.loop import main

    config, result = run
    assert config.match_input == "embedding" and result["quality"]["random_location_transitions"] > 0
    agent, _ = load_checkpoint(Path(config.run_dir) / "worldmodel.pt")
    assert agent.mdrnn.match_features == 1 + config.hidden
    assert agent.mdrnn.rnn.input_size == config.latent_size + agent.n_rules + 1 + 1
    assert len(agent.mdrnn.match_heads) == config.reward_ensemble
    assert agent.mdrnn.match_heads[0][0].in_features == agent.mdrnn.reward_heads[0][0].in_features + 1 + config.hidden
    with pytest.raises(ValueError, match="match_input must be one of"):
        main(dataclasses.replace(config, match_input="everything", out=str(tmp_path / "results"),
                                 run_dir=str(tmp_path / "run")))


def test_an_unknown_match_input_on_the_command_line_is_a_usage_error(capsys):
    """The command line offers match_input's values as choices: a wrong one exits 2 with one error line, before any
    work; a right one reaches the Config."""
    from rlflow.cli import main
    from rlflow.cli.train import parse_config
    from rlflow.train.worldmodel.config import Config

    assert parse_config(Config, ["--match-input", "score"]).match_input == "score"
    assert main(["train", "--algo", "worldmodel", "--match-input", "everything"]) == 2
    assert "'everything' is not one of" in capsys.readouterr().err


def test_a_negative_reward_symlog_is_refused_before_anything_is_written(tmp_path):
    """A knee below 0 has no meaning: `main` refuses it with an input error (one line from the command line) before
    it builds a model or writes a file."""
    import dataclasses

    from rlflow.errors import InputError
    from rlflow.train.worldmodel.loop import Config, main

    config = dataclasses.replace(Config(), reward_symlog=-1.0, out=str(tmp_path / "out"), run_dir=str(tmp_path / "run"))
    with pytest.raises(InputError, match="reward_symlog must be >= 0"):
        main(config)
    assert not any(tmp_path.iterdir())


def _agent_whose_m_predicts(config, pays: dict[int, float], spread: float = 0.0):
    """An agent whose M predicts reward `pays[a]` (in % of the runtime, 0 for other actions) for action a from any
    state, the two ensemble members `spread` apart (mean as given)."""
    from rlflow.agents.worldmodel_agent import Agent
    from rlflow.rewrites import RULES

    agent = Agent(config, len(RULES))
    m = agent.mdrnn
    offset, lowest = m.hidden + m.latent_size, min(pays.values())
    with torch.no_grad():
        for member, head in enumerate(m.reward_heads):
            first, last = head[0], head[2]
            first.weight.zero_(), first.bias.zero_(), last.weight.zero_()
            for action, reward in pays.items():  # hidden unit 0 carries the action's reward, lifted above 0
                first.weight[0, offset + action] = (reward - lowest + 1.0) / config.reward_scale
            last.weight[0, 0] = 1.0
            last.bias.fill_((lowest - 1.0 + (spread / 2 if member else -spread / 2)) / config.reward_scale)
    return agent


def test_planning_takes_the_rule_m_predicts_to_pay_most_as_the_dream_pays_it(tiny_model, wm_cost_model):
    """With `Planning` (greedy_by="model") a greedy episode takes the rule M predicts to pay most, its reward
    counted as the dream pays it (ensemble mean less the penalty times its spread, clipped to the rule's range), and
    stops once none is predicted to pay; without it (and for checkpoints from before the option) the controller's
    argmax; sampled choices stay the controller's."""
    import numpy as np

    from rlflow.agents.actor import WorldModelActor
    from rlflow.agents.worldmodel_agent import Memory, Planning
    from rlflow.env.observation import NEG
    from rlflow.env.rewrite_env import RewriteEnv
    from rlflow.rewrites import RULES
    from rlflow.train.worldmodel.config import Config
    from rlflow.train.worldmodel.episodes import real_episode
    from rlflow.train.worldmodel.replay import Replay

    assert Planning.of({}) is None and Planning.of({"greedy_by": "controller"}) is None
    assert Planning.of({"greedy_by": "model", "reward_scale": 5.0}) == Planning(5.0, 1.0, None)
    config = Config(hidden=16, rounds=1, learn_location=False, reward_symlog=0.0, reward_ensemble=2, max_nodes=128,
                    max_edges=256, max_candidates=64)
    env = RewriteEnv(tiny_model, cost_model=wm_cost_model, max_episode_steps=4, max_nodes=128, max_edges=256,
                     max_candidates=64)
    obs, _ = env.reset()
    listed = sorted({int(r) for r in np.asarray(obs["cand_rule"])[np.asarray(obs["cand_mask"]).astype(bool)]})
    assert len(listed) >= 2
    favourite, second = listed[0], listed[1]
    agent = _agent_whose_m_predicts(config, {favourite: 3.0, second: 1.0}, spread=0.4)
    with torch.no_grad():  # the controller prefers the other rule
        agent.policy.actor[-1].weight.zero_()
        agent.policy.actor[-1].bias.fill_(-5.0)
        agent.policy.actor[-1].bias[second] = 5.0

    rewards = Memory(agent, Planning(config.reward_scale, 1.0)).predicted_rewards(obs)
    assert float(rewards[favourite]) == pytest.approx(3.0 - 0.2, abs=1e-4)  # mean less one spread (0.2 each side)
    assert float(rewards[second]) == pytest.approx(1.0 - 0.2, abs=1e-4)
    assert float(rewards[-1]) == 0.0 and all(float(rewards[r]) == NEG for r in range(len(RULES)) if r not in listed)
    assert float(Memory(agent, Planning(config.reward_scale, 0.0)).predicted_rewards(obs)[favourite]) == \
        pytest.approx(3.0, abs=1e-4)
    clipped = Memory(agent, Planning(config.reward_scale, 0.0, (-1.0, 2.5))).predicted_rewards(obs)
    assert float(clipped[favourite]) == pytest.approx(2.5)

    replay, rng = Replay(len(RULES)), np.random.default_rng(0)
    planned = real_episode(env, 0, agent, replay, rng, greedy=True, planning=Planning(config.reward_scale, 1.0))
    assert planned.actions[0] == favourite
    assert real_episode(env, 0, agent, replay, rng, greedy=True).actions[0] == second  # the controller's argmax
    avoiding = real_episode(env, 0, agent, replay, rng, greedy=True, avoid_revisits=True,
                            planning=Planning(config.reward_scale, 1.0))
    assert avoiding.actions[0] == favourite
    nothing_pays = _agent_whose_m_predicts(config, {r: -1.0 for r in listed})
    assert real_episode(env, 0, nothing_pays, replay, rng, greedy=True,
                        planning=Planning(config.reward_scale, 0.0)).actions == [len(RULES)]  # terminate

    def chosen_rule(logits):
        return int(np.asarray(obs["cand_rule"])[int(logits.argmax())])

    old = WorldModelActor(agent, {"reward_scale": config.reward_scale})  # a checkpoint from before greedy_by
    planning = WorldModelActor(agent, {"reward_scale": config.reward_scale, "greedy_by": "model"})
    assert chosen_rule(old.greedy_logits(obs)) == second and chosen_rule(planning.greedy_logits(obs)) == favourite
    assert torch.equal(planning.logits(obs), old.logits(obs))  # the sampled rollouts: the controller's
