"""The PPO trainer: an update changes the policy, counters and outputs are written, the command line parses."""
from __future__ import annotations

import json

import torch

from rlflow.agents.policy import CandidatePolicy, load_checkpoint
from rlflow.rewrites import RULES
from rlflow.train import ppo


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
        assert row["same_graph"] == (row["agent_over_random_walk"] is None)
        for part in ("policy", "agent", "random_walk"):
            assert row[part]["measured"]["low"] <= row[part]["measured"]["median"] <= row[part]["measured"]["high"]
        assert row["agent"]["measured_candidates"] <= 6 and row["random_walk"]["estimated_speedup"] > 0
    summary = result["summary"]
    assert summary["trained"]["models"] == 1 and summary["heldout"]["models"] == 1
    assert sum(summary["trained"]["outcomes"].values()) == 1
    assert result["train"]["random_policy_mean_return"] is not None


def test_evaluate_command_adds_the_evaluation_to_a_training_run(tmp_path, zoo_paths, monkeypatch):
    from rlflow.cli import main
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    config = tiny_config(tmp_path, [zoo_paths["resnet-18-tiny"]], eval_walks=2, eval_rounds=3, eval_time_limit=5.0)
    ppo.main(config)
    assert "eval" not in json.loads((tmp_path / "out" / "ppo.json").read_text())
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run" / "ppo.pt"), "--results",
                 str(tmp_path / "out" / "ppo.json"), "--out", str(tmp_path / "evaluated")]) == 0
    written = json.loads((tmp_path / "evaluated" / "ppo.json").read_text())
    assert [r["model"] for r in written["eval"]] == ["resnet-18-tiny"]
    assert written["train"]["real_steps"] == 16 and "--checkpoint" in written["eval_command"]
    assert (tmp_path / "evaluated" / "ppo-learning-curve.png").stat().st_size > 0


def test_parse_args():
    from rlflow.cli.train import parse_config

    config = parse_config(ppo.Config, ["--models", "a-tiny,b.onnx", "--total-steps", "64", "--no-evaluate",
                                       "--target-kl", "0.02", "--out", "x"])
    assert config.models == ("a-tiny", "b.onnx") and config.total_steps == 64 and not config.evaluate
    assert config.target_kl == 0.02 and config.out == "x" and config.holdout == ppo.Config().holdout


def test_trains_for_cuda_on_a_machine_without_it_against_the_shipped_table(tmp_path, zoo_paths, monkeypatch):
    import onnxruntime as ort
    import pytest

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine runs CUDA: its cost model measures")
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path / "cache"))
    config = tiny_config(tmp_path, [zoo_paths["resnet-18-tiny"]], provider="cuda", evaluate=True)
    result = ppo.main(config)
    assert result["train"]["real_steps"] == 16 and "eval" not in result  # nothing can be measured: no evaluation
    _, payload = load_checkpoint(tmp_path / "run" / "ppo.pt")
    assert payload["config"]["provider"] == "cuda"
    assert not (tmp_path / "cache" / "costmodel").exists()  # the device's table is read; no local table is written
