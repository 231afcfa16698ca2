"""`--finetune N`: the agent adapts to the user's model with PPO steps against the cost model, on a copy, in time."""
from __future__ import annotations

import json
import time

import pytest
import torch

import rlflow
from rlflow.agents.policy import CandidatePolicy, save_checkpoint
from rlflow.cli import main
from rlflow.rewrites import RULES
from rlflow.train.finetune import ROLLOUT_STEPS, finetune


@pytest.fixture
def policy():
    torch.manual_seed(0)
    return CandidatePolicy(len(RULES), hidden=16, rounds=2).eval()


def test_finetune_adapts_a_copy_for_the_steps_asked(zoo_paths, cost_model, policy):
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    graph = rlflow.load(zoo_paths["resnet-18-tiny"])
    adapted, report = finetune(policy, graph, ROLLOUT_STEPS + 1, cost_model=cost_model)
    assert report.updates == 2 and report.steps == 2 * ROLLOUT_STEPS and report.stop_reason == "steps done"
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items()), "the given policy must not change"
    assert any(not torch.equal(before[k], v) for k, v in adapted.state_dict().items()), "PPO updated the copy"
    assert not adapted.training and report.mean_return_first is not None


def test_finetune_stops_at_its_deadline(zoo_paths, cost_model, policy):
    graph = rlflow.load(zoo_paths["resnet-18-tiny"])
    _, report = finetune(policy, graph, 100 * ROLLOUT_STEPS, cost_model=cost_model, deadline=time.monotonic())
    assert report.updates == 0 and report.stop_reason == "time limit"


def test_optimize_finetune_from_the_command_line(zoo_paths, policy, tmp_path):
    checkpoint = save_checkpoint(tmp_path / "agent.pt", policy)
    out, report_path = tmp_path / "out.onnx", tmp_path / "report.json"
    code = main(["optimize", zoo_paths["resnet-18-tiny"], "-o", str(out), "--json", str(report_path), "--quiet",
                 "--agent", str(checkpoint), "--finetune", "10", "--time-limit", "20"])
    assert code == 0 and out.exists()
    tuned = json.loads(report_path.read_text())["settings"]["finetune"]
    assert tuned["updates"] == 1 and tuned["steps"] == ROLLOUT_STEPS


def test_finetune_is_refused_for_the_searches(zoo_paths, tmp_path, capsys):
    code = main(["optimize", zoo_paths["resnet-18-tiny"], "-o", str(tmp_path / "o.onnx"), "--method", "greedy",
                 "--finetune", "10"])
    assert code == 2 and "--finetune" in capsys.readouterr().err and not (tmp_path / "o.onnx").exists()
