"""Shipping an agent: an inference-only checkpoint under the size budget, with provenance the bench can read."""
from __future__ import annotations

import json

import pytest
import torch

from rlflow.agents.policy import CandidatePolicy, load_checkpoint, save_checkpoint
from rlflow.errors import RlflowError
from rlflow.rewrites import RULES
from rlflow.search.agent import DEFAULT_AGENT, load_agent
from rlflow.train import ship


def _run(tmp_path):
    policy = CandidatePolicy(len(RULES), hidden=16, rounds=2)
    optimizer = torch.optim.Adam(policy.parameters())
    config = {"models": ["models/resnet-18-tiny.onnx"], "holdout": ["vit-b-16-tiny", "demo-block"]}  # a path: its name
    checkpoint = save_checkpoint(tmp_path / "ppo.pt", policy, optimizer, config, real_steps=64)
    results = tmp_path / "ppo.json"
    results.write_text(json.dumps({"algo": "ppo", "train": {"real_steps": 64, "seconds": 1.0,
                                                            "final_mean_return": 0.5}}))
    return policy, checkpoint, results


def test_ship_writes_weights_without_optimizer_and_provenance(tmp_path):
    policy, checkpoint, results = _run(tmp_path)
    meta = ship.ship(checkpoint, results, tmp_path / "agents")
    shipped, payload = load_checkpoint(tmp_path / "agents" / "ppo.pt")
    assert payload["optimizer"] is None and meta["bytes"] == (tmp_path / "agents" / "ppo.pt").stat().st_size
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in shipped.state_dict().items())
    assert meta["held_out"] == ["vit-b-16-tiny", "demo-block"] and meta["trained_on"] == ["resnet-18-tiny"]
    assert meta["provider"] == "cpu"  # what `rlflow optimize` reads to choose its default method
    agents = tmp_path / "agents"
    assert not ship.is_held_out("resnet-18", agents, "ppo") and not ship.is_held_out("resnet-18-tiny", agents, "ppo")
    assert ship.is_held_out("vit-b-16", agents, "ppo") and ship.is_held_out("demo-block", agents, "ppo")
    assert ship.is_held_out("nasnet-a-mobile", agents, "ppo")  # in neither list: never trained on, so held out
    assert not ship.is_held_out("vit-b-16", tmp_path / "nowhere")


def test_ship_refuses_an_agent_over_budget(tmp_path, monkeypatch):
    _, checkpoint, results = _run(tmp_path)
    monkeypatch.setattr(ship, "MAX_BYTES", 1000)
    with pytest.raises(RlflowError, match="package-data budget"):
        ship.ship(checkpoint, results, tmp_path / "agents")
    assert not (tmp_path / "agents" / "ppo.pt").exists()


def test_the_shipped_agent_loads_under_this_registry():
    meta = json.loads(DEFAULT_AGENT.with_suffix(".json").read_text())
    assert meta["bytes"] == DEFAULT_AGENT.stat().st_size <= ship.MAX_BYTES
    assert len(meta["held_out"]) >= 4 and not set(meta["held_out"]) & set(meta["trained_on"])
    from rlflow.agents.actor import WorldModelActor

    assert meta["algo"] == "worldmodel" and isinstance(load_agent(), WorldModelActor)  # the world-model agent
    ppo = DEFAULT_AGENT.with_name("ppo.pt")  # the model-free baseline ships beside it
    assert isinstance(load_agent(ppo), CandidatePolicy)
    assert json.loads(ppo.with_suffix(".json").read_text())["trained_on"] == meta["trained_on"]


def test_a_deployment_export_counts_as_seen_at_any_shape_and_exporter(tmp_path):
    (tmp_path / "default.json").write_text(json.dumps({"trained_on": ["distilbert-base-s16-ts", "resnet-18-tiny"]}))
    assert not ship.is_held_out("distilbert-base-s128-dynamo", tmp_path)  # the same architecture
    assert ship.is_held_out("bert-l2-h128-s16-ts", tmp_path) and not ship.is_held_out("resnet-18", tmp_path)
    assert ship.architecture("my-model") == "my-model"  # a file the zoo does not know: its own name


def test_a_model_file_counts_as_its_zoo_name(tmp_path):
    (tmp_path / "default.json").write_text(json.dumps({"trained_on": ["models/distilbert-base-s16-ts.onnx"]}))
    assert not ship.is_held_out("distilbert-base-s128-dynamo", tmp_path)  # a run given paths trained on it
    assert ship.is_held_out("bert-l2-h128-s16-ts", tmp_path)
    assert ship.architecture("elsewhere/my-model.onnx") == "my-model"
