"""`rlflow train --algo worldmodel --ray`: the real episodes played on a simulated two-node cluster, the report and
checkpoint as a run here, the nodes' cost-table gains merged into the driver's table, a killed worker's episode the
only one lost."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("ray")


def _dies_once(marker: str):
    """`rlflow.train.cluster.play`, whose worker process is killed the first time only (a marker file remembers)."""
    from rlflow.train import cluster

    def play(*args):
        try:  # atomic: both nodes' first tasks start together, and only one of them may die
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return cluster.play(*args)
        os._exit(1)

    return play


def test_a_world_model_run_plays_its_real_episodes_on_the_cluster(two_nodes, tiny_model, tmp_path, monkeypatch):
    import sys

    import ray

    from rlflow.agents.worldmodel_agent import load_checkpoint
    from rlflow.train import cluster as train_ray
    from rlflow.train.worldmodel.loop import Config, main

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import the tests package
    monkeypatch.setattr(train_ray, "play", _dies_once(str(tmp_path / "died")))  # a worker killed mid-episode

    config = Config(models=(tiny_model,), iterations=2, random_steps=40, collect_steps=20, vae_epochs=2,
                    mdrnn_epochs=3, dream_steps=512, dream_envs=16, dream_rollout=16, max_nodes=128,
                    max_edges=256, max_candidates=64, out=str(tmp_path / "results"), run_dir=str(tmp_path / "run"),
                    ppo_results=str(tmp_path / "missing.json"), cost_cache=str(tmp_path / "driver-costs"),
                    ray=two_nodes.address)
    result = main(config)
    cluster = result["cluster"]
    agent, payload = load_checkpoint(Path(config.run_dir) / "worldmodel.pt")  # the local run's format
    episodes = payload["replay"]["episodes"]
    assert sum(n["tasks"] for n in cluster["nodes"].values()) == len(episodes)  # a task per episode
    assert cluster["lost_tasks"] == 1  # the killed worker's: that episode only
    assert sum(n["steps"] for n in cluster["nodes"].values()) == result["real_steps_worldmodel"] >= 60
    assert len(cluster["nodes"]) == 2  # both nodes played
    assert result["real_episode_seconds"] > 0 and result["reward_pearson"] is not None
    assert sum(len(e["states"]) for e in episodes) > len(payload["replay"]["states"])  # states stored once
    tables = cluster["cost_tables"]
    assert tables["added"] > 0 and tables["known_before"] == 0
    costs = sum(len(json.loads(p.read_text())["costs"]) for p in Path(config.cost_cache).glob("costmodel-*.json"))
    assert costs == tables["added"]  # what the nodes measured came home
    assert json.loads((Path(config.out) / "worldmodel.json").read_text())["cluster"]["nodes"]


def test_the_ray_option_alone_means_a_cluster_started_here():
    from rlflow.cli.train import parse_config
    from rlflow.train.worldmodel.config import Config

    assert parse_config(Config, ["--ray"]).ray == "local"
    assert parse_config(Config, ["--ray", "--seed", "1"]).ray == "local"  # an option after it leaves its value out
    assert parse_config(Config, ["--ray", "auto"]).ray == "auto" and parse_config(Config, []).ray is None


def test_masked_ppo_plays_each_update_as_one_segment_per_node(two_nodes, tiny_model, tmp_path):
    from rlflow.agents.policy import load_checkpoint
    from rlflow.train import ppo

    config = ppo.Config(models=(tiny_model,), holdout=(), total_steps=32, num_steps=16, num_minibatches=2,
                        update_epochs=1, hidden=16, max_episode_steps=6, max_nodes=256, max_edges=512,
                        max_candidates=32, evaluate=False, baseline_episodes=0, out=str(tmp_path / "out"),
                        run_dir=str(tmp_path / "run"), ray=two_nodes.address)
    result = ppo.main(config)
    cluster = result["cluster"]
    assert result["train"]["real_steps"] == 32 and cluster["lost_tasks"] == 0
    assert len(cluster["nodes"]) == 2 and all(n["tasks"] == 2 and n["steps"] == 16 for n in cluster["nodes"].values())
    _, payload = load_checkpoint(tmp_path / "run" / "ppo.pt")  # the local run's format
    assert payload["real_steps"] == 32
    steps = [e["real_steps"] for e in result["curve"]]
    assert steps == sorted(steps) and all(0 < s <= 32 for s in steps)
