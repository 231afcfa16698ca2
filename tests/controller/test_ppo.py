"""The PPO trainer: an update changes the policy, counters and outputs are written, the command line parses."""
from __future__ import annotations

import json

import torch

from rlflow.controller import ppo
from rlflow.controller.policy import CandidatePolicy, load_checkpoint
from rlflow.rewrites import RULES


def tiny_config(tmp_path, models, **overrides) -> ppo.Config:
    settings = dict(models=tuple(models), holdout=(), total_steps=16, num_steps=16, num_minibatches=2,
                    update_epochs=1, hidden=16, max_episode_steps=6, max_nodes=256, max_edges=512,
                    max_candidates=32, evaluate=False, baseline_episodes=0, out=str(tmp_path / "out"),
                    run_dir=str(tmp_path / "run"))
    settings.update(overrides)
    return ppo.Config(**settings)


def test_one_update_changes_the_parameters_and_counts_steps(tmp_path, zoo_paths, monkeypatch):
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    config = tiny_config(tmp_path, [zoo_paths["resnet-18-tiny"]])
    result = ppo.main(config)
    assert result["train"]["real_steps"] == 16 and result["train"]["measurements"] == 0
    trained, payload = load_checkpoint(tmp_path / "run" / "ppo.pt")
    assert payload["config"]["total_steps"] == 16 and payload["real_steps"] == 16
    torch.manual_seed(config.seed)
    initial = CandidatePolicy(len(RULES), config.hidden, config.rounds).state_dict()
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, initial[k])]
    assert changed and any(k.startswith("encoder.") for k in changed)
    assert json.loads((tmp_path / "out" / "ppo.json").read_text())["train"]["real_steps"] == 16
    assert (tmp_path / "out" / "ppo-learning-curve.png").stat().st_size > 0
    tags = (tmp_path / "run" / "metrics.csv").read_text()
    assert "losses/policy_loss" in tags and "charts/real_steps" in tags


def test_evaluation_against_random_walk(tmp_path, zoo_paths, monkeypatch):
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    config = tiny_config(tmp_path, [zoo_paths["resnet-18-tiny"]], holdout=(zoo_paths["bert-base-tiny"],),
                         evaluate=True, eval_walks=2, eval_rounds=3, eval_time_limit=10.0, baseline_episodes=1)
    result = ppo.main(config)
    rows = {row["model"]: row for row in result["eval"]}
    assert set(rows) == {"resnet-18-tiny", "bert-base-tiny"} and rows["bert-base-tiny"]["heldout"]
    for row in rows.values():
        assert row["outcome"] in ("win", "tie", "loss")
        assert row["policy"]["measured"]["median"] > 0 and row["random_walk"]["estimated_speedup"] > 0
    assert result["summary"]["models"] == 1 and result["train"]["random_policy_mean_return"] is not None


def test_parse_args():
    config = ppo.parse_args(["--models", "a-tiny,b.onnx", "--total-steps", "64", "--no-evaluate",
                             "--target-kl", "0.02", "--out", "x"])
    assert config.models == ("a-tiny", "b.onnx") and config.total_steps == 64 and not config.evaluate
    assert config.target_kl == 0.02 and config.out == "x" and config.holdout == ppo.Config().holdout
